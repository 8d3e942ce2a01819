//! What a counter counts: a rule, a subject and a window.

use arcstr::ArcStr;
use equivalent::Equivalent;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::hash::{Hash, Hasher};

/// The longest rule name, in bytes.
pub const RULE_BYTES_MAX: usize = 64;
/// The longest subject, in bytes.
pub const SUBJECT_BYTES_MAX: usize = 256;
/// The longest window, in seconds (one week).
pub const WINDOW_SECS_MAX: u32 = 7 * 24 * 3600;
/// The highest window index. An index is held in 32 bits, so a window of one second can
/// start as late as 2106 (unix second 2^32 - 1), a longer one later in proportion.
pub const WINDOW_INDEX_MAX: u64 = u32::MAX as u64;

/// A key that does not fit its bounds. Nothing was created.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The rule name is empty, too long, or has a character outside `[A-Za-z0-9_.:-]`.
    #[error("rule: {0:?} must be 1 to {RULE_BYTES_MAX} bytes of [A-Za-z0-9_.:-]")]
    Rule(String),
    /// The subject is empty or longer than [`SUBJECT_BYTES_MAX`] bytes.
    #[error("subject: {len} bytes, must be 1 to {SUBJECT_BYTES_MAX}")]
    Subject {
        /// The subject's length in bytes.
        len: usize,
    },
    /// The window length is zero or longer than [`WINDOW_SECS_MAX`].
    #[error("window: length {len_secs} s, must be 1 to {WINDOW_SECS_MAX}")]
    WindowLen {
        /// The refused window length.
        len_secs: u32,
    },
    /// The window index is above [`WINDOW_INDEX_MAX`].
    #[error("window: index {index}, must be at most {WINDOW_INDEX_MAX}")]
    WindowIndex {
        /// The refused index.
        index: u64,
    },
}

/// The name of a rule, as configured: 1 to 64 bytes of `[A-Za-z0-9_.:-]`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Rule(ArcStr);

/// What a rule counts for: a user, an IP, an API key. 1 to 256 bytes of UTF-8.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Subject(ArcStr);

/// A fixed time window: `index = floor(unix_secs / len_secs)`.
///
/// The node that first counts a key fixes its window and the window travels with the key:
/// no receiver re-derives it from its own clock, so a skewed clock cannot move counts
/// between windows.
///
/// Held in 8 bytes (an index of at most [`WINDOW_INDEX_MAX`]); sent as a `u64` index and
/// a `u32` length, checked on the way back in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "WindowParts", into = "WindowParts")]
pub struct Window {
    index: u32,
    len_secs: u32,
}

/// The key of one counter: 24 bytes, two thin pointers to shared strings and the window.
/// Cloning is cheap: the strings are shared.
///
/// Invariant: hashes as the [`KeyRef`] with the same parts. The derived `Hash` feeds the
/// rule's `str`, the subject's `str`, then the window, as `KeyRef`'s hand-written one
/// does; keep the fields in this order.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Key {
    /// The rule that counts.
    pub rule: Rule,
    /// What it counts for.
    pub subject: Subject,
    /// When it counts.
    pub window: Window,
}

impl Rule {
    /// Checks the bounds and makes a rule name.
    pub fn new(name: impl AsRef<str>) -> Result<Rule, KeyError> {
        let name = name.as_ref();
        let valid = !name.is_empty()
            && name.len() <= RULE_BYTES_MAX
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-'));
        if valid {
            Ok(Rule(name.into()))
        } else {
            Err(KeyError::Rule(name.to_owned()))
        }
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Subject {
    /// Checks the bounds and makes a subject.
    pub fn new(subject: impl AsRef<str>) -> Result<Subject, KeyError> {
        let subject = subject.as_ref();
        Subject::check(subject)?;
        Ok(Subject(subject.into()))
    }

    fn check(subject: &str) -> Result<(), KeyError> {
        if subject.is_empty() || subject.len() > SUBJECT_BYTES_MAX {
            return Err(KeyError::Subject { len: subject.len() });
        }
        Ok(())
    }

    /// The subject.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Window {
    /// The window of length `len_secs` that holds the instant `unix_secs`.
    pub fn containing(unix_secs: u64, len_secs: u32) -> Result<Window, KeyError> {
        Window::new(unix_secs / u64::from(len_secs.max(1)), len_secs)
    }

    /// The window with this index and length.
    pub fn new(index: u64, len_secs: u32) -> Result<Window, KeyError> {
        if len_secs == 0 || len_secs > WINDOW_SECS_MAX {
            return Err(KeyError::WindowLen { len_secs });
        }
        let index = u32::try_from(index).map_err(|_| KeyError::WindowIndex { index })?;
        Ok(Window { index, len_secs })
    }

    /// `floor(start / len)`.
    pub fn index(&self) -> u64 {
        u64::from(self.index)
    }

    /// The window's length in seconds.
    pub fn len_secs(&self) -> u32 {
        self.len_secs
    }

    /// The unix second at which the window opens.
    pub fn start_unix_secs(&self) -> u64 {
        self.index() * u64::from(self.len_secs)
    }

    /// The unix second at which the window closes (exclusive).
    pub fn end_unix_secs(&self) -> u64 {
        self.start_unix_secs() + u64::from(self.len_secs)
    }

    /// The window just before this one, if there is one.
    pub fn previous(&self) -> Option<Window> {
        Some(Window {
            index: self.index.checked_sub(1)?,
            len_secs: self.len_secs,
        })
    }

    /// Whether a counter in this window is still needed at `now_unix_secs`.
    ///
    /// A window is kept for one more length after it closes, because a sliding-window
    /// estimate weights the previous window.
    pub fn is_live(&self, now_unix_secs: u64) -> bool {
        now_unix_secs < self.live_until_unix_secs()
    }

    /// The first second at which this window is no longer live ([`Window::is_live`]).
    pub fn live_until_unix_secs(&self) -> u64 {
        self.end_unix_secs() + u64::from(self.len_secs)
    }
}

impl Key {
    /// A key from its parts.
    pub fn new(rule: Rule, subject: Subject, window: Window) -> Key {
        Key {
            rule,
            subject,
            window,
        }
    }

    /// The encoded size of everything in a key but its strings' bytes, at most.
    pub const ENCODED_FIXED_MAX: usize = 2 * 9 + 9 + 5;
}

impl TryFrom<String> for Rule {
    type Error = KeyError;
    fn try_from(name: String) -> Result<Rule, KeyError> {
        Rule::new(name)
    }
}

impl From<Rule> for String {
    fn from(rule: Rule) -> String {
        rule.as_str().to_owned()
    }
}

impl TryFrom<String> for Subject {
    type Error = KeyError;
    fn try_from(subject: String) -> Result<Subject, KeyError> {
        Subject::new(subject)
    }
}

impl From<Subject> for String {
    fn from(subject: Subject) -> String {
        subject.as_str().to_owned()
    }
}

/// A key by its parts, the subject borrowed: what a node looks a counter up by, so that
/// only a new key costs the allocation of its subject. It hashes as, and is
/// [`Equivalent`] to, the [`Key`] with the same parts, for maps keyed by `Key`.
#[derive(Debug, Clone, Copy)]
pub struct KeyRef<'a> {
    rule: &'a Rule,
    subject: &'a str,
    window: Window,
    /// The subject as the [`Key`] this was borrowed from holds it: [`KeyRef::to_key`] then
    /// shares it rather than copying it.
    held_subject: Option<&'a Subject>,
}

impl PartialEq for KeyRef<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.rule == other.rule && self.subject == other.subject && self.window == other.window
    }
}

impl Eq for KeyRef<'_> {}

impl Hash for KeyRef<'_> {
    /// As `Key`'s derived `Hash`: the rule's `str`, the subject's `str`, then the window.
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.rule.hash(state);
        self.subject.hash(state);
        self.window.hash(state);
    }
}

impl<'a> KeyRef<'a> {
    /// Checks the subject's bounds (as [`Subject::new`] does) and makes a borrowed key.
    pub fn new(rule: &'a Rule, subject: &'a str, window: Window) -> Result<KeyRef<'a>, KeyError> {
        Subject::check(subject)?;
        Ok(KeyRef {
            rule,
            subject,
            window,
            held_subject: None,
        })
    }

    /// A key held by its parts, as a map's key table holds it: [`KeyRef::to_key`] shares
    /// its strings.
    pub(crate) fn held(rule: &'a Rule, subject: &'a Subject, window: Window) -> KeyRef<'a> {
        KeyRef {
            rule,
            subject: subject.as_str(),
            window,
            held_subject: Some(subject),
        }
    }

    /// The rule.
    pub fn rule(&self) -> &'a Rule {
        self.rule
    }

    /// The subject.
    pub fn subject(&self) -> &'a str {
        self.subject
    }

    /// The window.
    pub fn window(&self) -> Window {
        self.window
    }

    /// Whether the subject is `subject`. Shared strings compare by pointer first: a key
    /// looked up by a key that shares its subject (as the gossip side's keys share the lane
    /// store's) is found without reading the string, a cache miss in a large map.
    pub fn subject_is(&self, subject: &Subject) -> bool {
        match self.held_subject {
            Some(held) => held == subject,
            None => self.subject == subject.as_str(),
        }
    }

    /// An upper bound on the key's encoded size in bytes, for frame budgets: the strings
    /// plus a length prefix each and the window's two integers at their widest.
    pub fn encoded_len_max(&self) -> usize {
        self.rule.0.len() + self.subject.len() + Key::ENCODED_FIXED_MAX
    }

    /// The same parts in another window.
    pub fn in_window(&self, window: Window) -> KeyRef<'a> {
        KeyRef { window, ..*self }
    }

    /// The owned key: shares the rule's name, and the subject too if this was borrowed from
    /// a `Key`; copies the subject otherwise.
    pub fn to_key(&self) -> Key {
        Key::new(self.rule.clone(), self.to_subject(), self.window)
    }

    /// The subject, sharing its string if this was borrowed from a [`Key`].
    pub fn to_subject(&self) -> Subject {
        match self.held_subject {
            Some(held) => held.clone(),
            None => Subject(self.subject.into()),
        }
    }
}

impl<'a> From<&'a Key> for KeyRef<'a> {
    fn from(key: &'a Key) -> KeyRef<'a> {
        KeyRef {
            rule: &key.rule,
            subject: key.subject.as_str(),
            window: key.window,
            held_subject: Some(&key.subject),
        }
    }
}

impl Equivalent<Key> for KeyRef<'_> {
    fn equivalent(&self, key: &Key) -> bool {
        self.window == key.window && *self.rule == key.rule && self.subject_is(&key.subject)
    }
}

/// The serialized form of a [`Window`], checked on the way back in.
#[derive(Serialize, Deserialize)]
struct WindowParts {
    index: u64,
    len_secs: u32,
}

impl TryFrom<WindowParts> for Window {
    type Error = KeyError;
    fn try_from(parts: WindowParts) -> Result<Window, KeyError> {
        Window::new(parts.index, parts.len_secs)
    }
}

impl From<Window> for WindowParts {
    fn from(window: Window) -> WindowParts {
        WindowParts {
            index: window.index(),
            len_secs: window.len_secs,
        }
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}@{}x{}s",
            self.rule.as_str(),
            self.subject.as_str(),
            self.window.index,
            self.window.len_secs
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_rule_names_are_refused_with_the_name() {
        assert_eq!(Rule::new(""), Err(KeyError::Rule(String::new())));
        assert!(Rule::new("a b").is_err());
        assert!(Rule::new("x".repeat(RULE_BYTES_MAX + 1)).is_err());
        assert!(Rule::new("x".repeat(RULE_BYTES_MAX)).is_ok());
        assert!(Rule::new("api.login:per-ip_1").is_ok());
    }

    #[test]
    fn subject_bounds_are_enforced() {
        assert_eq!(Subject::new(""), Err(KeyError::Subject { len: 0 }));
        assert!(Subject::new("é".repeat(SUBJECT_BYTES_MAX)).is_err());
        assert!(Subject::new("u".repeat(SUBJECT_BYTES_MAX)).is_ok());
    }

    #[test]
    fn window_is_fixed_by_its_index_and_kept_one_length_past_its_end() {
        let w = Window::containing(125, 60).unwrap();
        assert_eq!(
            (w.index(), w.start_unix_secs(), w.end_unix_secs()),
            (2, 120, 180)
        );
        assert!(w.is_live(239));
        assert!(!w.is_live(240));
        assert_eq!(w.previous().unwrap().index(), 1);
        assert_eq!(Window::new(0, 0), Err(KeyError::WindowLen { len_secs: 0 }));
    }

    #[test]
    fn a_window_index_past_32_bits_is_refused_and_the_last_one_is_exact() {
        let last = Window::new(WINDOW_INDEX_MAX, WINDOW_SECS_MAX).unwrap();
        assert_eq!(last.index(), WINDOW_INDEX_MAX);
        assert_eq!(
            last.end_unix_secs(),
            (WINDOW_INDEX_MAX + 1) * u64::from(WINDOW_SECS_MAX)
        );
        let index = WINDOW_INDEX_MAX + 1;
        assert_eq!(Window::new(index, 1), Err(KeyError::WindowIndex { index }));
        assert_eq!(
            Window::containing(index, 1),
            Err(KeyError::WindowIndex { index })
        );
        assert!(Window::containing(index, 2).is_ok());
    }

    #[test]
    fn a_borrowed_key_hashes_and_compares_as_its_owned_key() {
        use std::hash::BuildHasher;
        let hasher = foldhash::fast::FixedState::with_seed(42);
        let rule = Rule::new("login").unwrap();
        let window = Window::new(7, 60).unwrap();
        let borrowed = KeyRef::new(&rule, "user-42", window).unwrap();
        let owned = borrowed.to_key();
        assert_eq!(
            owned,
            Key::new(rule.clone(), Subject::new("user-42").unwrap(), window)
        );
        assert_eq!(hasher.hash_one(borrowed), hasher.hash_one(&owned));
        assert_eq!(KeyRef::from(&owned), borrowed);
        assert_eq!(
            hasher.hash_one(KeyRef::from(&owned)),
            hasher.hash_one(&owned)
        );
        // Borrowed from a key, it shares that key's subject; borrowed from a `str`, it copies.
        let shared = KeyRef::from(&owned).to_key();
        assert!(ArcStr::ptr_eq(&shared.subject.0, &owned.subject.0));
        assert!(!ArcStr::ptr_eq(
            &borrowed.to_key().subject.0,
            &owned.subject.0
        ));
        assert!(borrowed.equivalent(&owned));
        // Borrowed from a key: equal by pointer when the subject is shared, else by bytes.
        assert!(KeyRef::from(&owned.clone()).equivalent(&owned));
        let copy = Key::new(rule.clone(), Subject::new("user-42").unwrap(), window);
        assert!(KeyRef::from(&copy).equivalent(&owned));
        let another = Key::new(rule.clone(), Subject::new("user-43").unwrap(), window);
        assert!(!KeyRef::from(&another).equivalent(&owned));
        let others = [
            KeyRef::new(&rule, "user-43", window).unwrap(),
            borrowed.in_window(Window::new(8, 60).unwrap()),
            borrowed.in_window(Window::new(7, 30).unwrap()),
        ];
        for other in others {
            assert!(!other.equivalent(&owned), "{other:?}");
        }
        let other_rule = Rule::new("logout").unwrap();
        assert!(!KeyRef::new(&other_rule, "user-42", window)
            .unwrap()
            .equivalent(&owned));
    }

    #[test]
    fn a_borrowed_key_checks_the_subject_as_an_owned_one_does() {
        let rule = Rule::new("login").unwrap();
        let window = Window::new(7, 60).unwrap();
        for subject in [String::new(), "u".repeat(SUBJECT_BYTES_MAX + 1)] {
            assert_eq!(
                KeyRef::new(&rule, &subject, window).unwrap_err(),
                Subject::new(subject.clone()).unwrap_err()
            );
        }
    }
}
