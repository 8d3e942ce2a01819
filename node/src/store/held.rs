//! A key as the lane store holds it: its subject and its scope (rule and window), the scope
//! held once for every key in it. 16 bytes where a [`Key`] takes 24, so a key and its slot
//! are one 40-byte allocation in the store's map.

use papaya::Equivalent;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use tally_crdt::{Key, KeyRef, Rule, Subject, Window};

/// A rule and a window: what the keys of one scope share.
#[derive(Debug, PartialEq, Eq, Hash)]
pub(super) struct Scope {
    rule: Rule,
    window: Window,
}

/// A scope as a look-up names it, borrowed.
#[derive(Debug, Hash)]
pub(super) struct ScopeRef<'a> {
    rule: &'a Rule,
    window: Window,
}

impl<'a> ScopeRef<'a> {
    /// The scope of `key`.
    pub(super) fn of(key: &KeyRef<'a>) -> ScopeRef<'a> {
        ScopeRef {
            rule: key.rule(),
            window: key.window(),
        }
    }

    /// The scope, to hold.
    pub(super) fn to_scope(&self) -> Arc<Scope> {
        Arc::new(Scope {
            rule: self.rule.clone(),
            window: self.window,
        })
    }
}

impl Equivalent<Arc<Scope>> for ScopeRef<'_> {
    fn equivalent(&self, scope: &Arc<Scope>) -> bool {
        self.window == scope.window && *self.rule == scope.rule
    }
}

/// A key held: its subject and its scope.
///
/// Hashes as [`Key`] and [`KeyRef`] do (the rule's `str`, the subject's `str`, then the
/// window), so the store's map finds it by either. Two held keys are equal when their
/// rule, subject and window are, whichever scope allocations they point to: a scope
/// dropped from the store's table of scopes while a key was being made in it leaves that
/// key with a copy of its own, which still compares by value.
#[derive(Debug, Clone)]
pub(super) struct HeldKey {
    subject: Subject,
    scope: Arc<Scope>,
}

const _: () = assert!(
    std::mem::size_of::<HeldKey>() == 16,
    "HeldKey grew past 16 bytes"
);

impl HeldKey {
    /// `key`, held in `scope` (which must be `key`'s: its rule and window).
    pub(super) fn new(key: &KeyRef<'_>, scope: Arc<Scope>) -> HeldKey {
        debug_assert!(ScopeRef::of(key).equivalent(&scope));
        HeldKey {
            subject: key.to_subject(),
            scope,
        }
    }

    /// The window.
    pub(super) fn window(&self) -> Window {
        self.scope.window
    }

    /// The key, sharing its strings.
    pub(super) fn to_key(&self) -> Key {
        self.clone().into_key()
    }

    /// The key, with this one's subject.
    pub(super) fn into_key(self) -> Key {
        Key::new(self.scope.rule.clone(), self.subject, self.scope.window)
    }
}

impl Hash for HeldKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.scope.rule.hash(state);
        self.subject.hash(state);
        self.scope.window.hash(state);
    }
}

impl PartialEq for HeldKey {
    fn eq(&self, other: &HeldKey) -> bool {
        self.subject == other.subject && *self.scope == *other.scope
    }
}

impl Eq for HeldKey {}

impl Equivalent<HeldKey> for KeyRef<'_> {
    fn equivalent(&self, held: &HeldKey) -> bool {
        self.window() == held.scope.window
            && *self.rule() == held.scope.rule
            && self.subject_is(&held.subject)
    }
}

impl Equivalent<HeldKey> for Key {
    fn equivalent(&self, held: &HeldKey) -> bool {
        KeyRef::from(self).equivalent(held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::KeyHasher;
    use std::hash::BuildHasher;

    fn key(rule: &str, subject: &str, window: u64) -> Key {
        Key::new(
            Rule::new(rule).unwrap(),
            Subject::new(subject).unwrap(),
            Window::new(window, 60).unwrap(),
        )
    }

    fn held(key: &Key) -> HeldKey {
        let borrowed = KeyRef::from(key);
        HeldKey::new(&borrowed, ScopeRef::of(&borrowed).to_scope())
    }

    #[test]
    fn a_held_key_hashes_as_its_key_and_its_borrowed_key() {
        let hasher = KeyHasher::new();
        for key in [
            key("login", "user-1", 7),
            key("a", "b", 0),
            key("x", "y", 1 << 31),
        ] {
            let held = held(&key);
            assert_eq!(hasher.hash_one(&held), hasher.hash_one(&key));
            assert_eq!(hasher.hash_one(&held), hasher.hash_one(KeyRef::from(&key)));
            assert_eq!(held.to_key(), key);
        }
    }

    #[test]
    fn a_held_key_is_its_key_and_no_other() {
        let key = key("login", "user-1", 7);
        let held = held(&key);
        assert!(key.equivalent(&held));
        // Its own subject, by pointer, and a copy of it, by its bytes.
        assert!(KeyRef::from(&key).equivalent(&held));
        let window = Window::new(7, 60).unwrap();
        assert!(KeyRef::new(&key.rule, "user-1", window)
            .unwrap()
            .equivalent(&held));
        for other in [
            self::key("login", "user-2", 7),
            self::key("logins", "user-1", 7),
            self::key("login", "user-1", 8),
        ] {
            assert!(!other.equivalent(&held), "{other}");
            assert_ne!(self::held(&other), held);
        }
        // Another scope allocation for the same rule and window.
        let elsewhere = self::held(&key);
        assert_eq!(
            elsewhere, held,
            "equal by value, whichever scope allocation"
        );
    }
}
