//! The rules and windows of a key table's keys, each held once: a held key names its
//! scope by a 4-byte id instead of holding its 16 bytes of rule and window.

use crate::{Rule, Window};
use hashbrown::HashTable;

/// A scope's place in its [`Scopes`]: fixed while a key is in it, reused after.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ScopeId(u32);

impl ScopeId {
    fn at(self) -> usize {
        self.0 as usize
    }
}

/// A rule and a window, and how many held keys are in them.
#[derive(Debug, Clone)]
struct Scope {
    rule: Rule,
    window: Window,
    keys: u32,
}

/// The scopes of a table's keys, found by id or by rule and window.
///
/// There are few (a rule's live windows, for each rule), but keys come from peers too, who
/// may name many: the scopes are found through a hash table, not by a walk.
#[derive(Debug, Clone, Default)]
pub(crate) struct Scopes {
    // Invariant: `Some` exactly at the ids not in `free`, each with at least one key in it.
    scopes: Vec<Option<Scope>>,
    free: Vec<ScopeId>,
    // Invariant: every id that is `Some`, once, at the hash of its rule and window.
    ids: HashTable<ScopeId>,
}

impl Scopes {
    /// The rule and window of `id`. Panics if no key is in it: a key names a scope its
    /// table no longer holds.
    pub(crate) fn get(&self, id: ScopeId) -> (&Rule, Window) {
        held(&self.scopes, id)
    }

    /// The scope of `rule` and `window`, held for one more key, under a new id if no key
    /// was in it. `hash` hashes a rule and window the same way every time.
    pub(crate) fn add_key(
        &mut self,
        rule: &Rule,
        window: Window,
        hash: impl Fn(&Rule, Window) -> u64,
    ) -> ScopeId {
        let scopes = &self.scopes;
        let found = self.ids.find(hash(rule, window), |&id| {
            let (held_rule, held_window) = held(scopes, id);
            held_window == window && held_rule == rule
        });
        if let Some(&id) = found {
            let scope = self.scopes[id.at()].as_mut().expect("an id found is held");
            scope.keys += 1;
            return id;
        }
        let id = self.free.pop().unwrap_or_else(|| {
            let at = u32::try_from(self.scopes.len()).expect("fewer than 2^32 scopes");
            self.scopes.push(None);
            ScopeId(at)
        });
        self.scopes[id.at()] = Some(Scope {
            rule: rule.clone(),
            window,
            keys: 1,
        });
        let scopes = &self.scopes;
        self.ids.insert_unique(hash(rule, window), id, |&id| {
            let (rule, window) = held(scopes, id);
            hash(rule, window)
        });
        id
    }

    /// Holds `id` for one key fewer, and forgets it once no key is in it.
    pub(crate) fn remove_key(&mut self, id: ScopeId, hash: impl Fn(&Rule, Window) -> u64) {
        let scope = self.scopes[id.at()]
            .as_mut()
            .expect("a key names a scope its table holds");
        scope.keys -= 1;
        if scope.keys > 0 {
            return;
        }
        let (rule, window) = held(&self.scopes, id);
        if let Ok(found) = self
            .ids
            .find_entry(hash(rule, window), |&other| other == id)
        {
            found.remove();
        }
        self.scopes[id.at()] = None;
        self.free.push(id);
    }

    /// How many scopes there is room for, held or free.
    #[cfg(test)]
    pub(crate) fn slots(&self) -> usize {
        self.scopes.len()
    }
}

/// The rule and window of `id`. Panics if no key is in it: a key names a scope its table
/// no longer holds.
fn held(scopes: &[Option<Scope>], id: ScopeId) -> (&Rule, Window) {
    let scope = scopes[id.at()]
        .as_ref()
        .expect("a key names a scope its table holds");
    (&scope.rule, scope.window)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(rule: &Rule, window: Window) -> u64 {
        // Few buckets, so that scopes share them.
        (rule.as_str().len() as u64 + u64::from(window.len_secs())) % 3
    }

    #[test]
    fn a_scope_is_held_while_a_key_is_in_it_and_its_id_reused_after() {
        let mut scopes = Scopes::default();
        let (login, api) = (Rule::new("login").unwrap(), Rule::new("api").unwrap());
        let minute = Window::containing(600, 60).unwrap();
        let hour = Window::containing(600, 3_600).unwrap();
        let first = scopes.add_key(&login, minute, hash);
        assert_eq!(
            scopes.add_key(&login, minute, hash),
            first,
            "the same scope"
        );
        let other = scopes.add_key(&api, minute, hash);
        let longer = scopes.add_key(&login, hour, hash);
        assert_ne!(other, first);
        assert_ne!(longer, first);
        assert_eq!(scopes.get(first), (&login, minute));
        assert_eq!(scopes.get(longer), (&login, hour));

        scopes.remove_key(first, hash);
        assert_eq!(scopes.get(first), (&login, minute), "one key left in it");
        scopes.remove_key(first, hash);
        let next = scopes.add_key(&api, hour, hash);
        assert_eq!(next, first, "freed, then reused");
        assert_eq!(scopes.get(next), (&api, hour));
        assert_eq!(
            scopes.add_key(&login, minute, hash),
            ScopeId(3),
            "forgotten"
        );
        assert_eq!(scopes.add_key(&api, minute, hash), other);
    }
}
