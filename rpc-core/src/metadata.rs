//! Per-call metadata: ordered key/value pairs sent with a request or a status.

use std::fmt;

use bytes::Bytes;

/// Metadata of a call: lowercase ASCII keys with byte-string values.
///
/// Keys may repeat; [`MetadataMap::get`] returns the first value. Values are
/// [`Bytes`], so received metadata points into the frame it came in.
///
/// ```
/// use rpc_core::MetadataMap;
///
/// let mut md = MetadataMap::new();
/// md.insert("x-request-id", "42");
/// assert_eq!(md.get_str("x-request-id"), Some("42"));
/// ```
#[derive(Clone, Default, PartialEq, Eq)]
pub struct MetadataMap {
    entries: Vec<(String, Bytes)>,
}

impl MetadataMap {
    /// An empty map.
    pub const fn new() -> MetadataMap {
        MetadataMap {
            entries: Vec::new(),
        }
    }

    /// Adds `key` = `value`, keeping earlier values for the same key.
    ///
    /// # Panics
    /// If `key` is empty or is not lowercase ASCII letters, digits, `-`, `_` or `.`:
    /// keys are code, not data, so a bad one is a programming error.
    pub fn insert(&mut self, key: impl Into<String>, value: impl Into<Bytes>) {
        let key = key.into();
        assert!(
            is_valid_key(&key),
            "invalid metadata key {key:?}: use lowercase a-z, 0-9, '-', '_', '.'"
        );
        self.entries.push((key, value.into()));
    }

    /// The first value for `key`.
    pub fn get(&self, key: &str) -> Option<&Bytes> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// The first value for `key`, if it is UTF-8.
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(|v| std::str::from_utf8(v).ok())
    }

    /// Every value for `key`, in order.
    pub fn get_all<'a>(&'a self, key: &'a str) -> impl Iterator<Item = &'a Bytes> + 'a {
        self.entries
            .iter()
            .filter(move |(k, _)| k == key)
            .map(|(_, v)| v)
    }

    /// Removes every value for `key`; returns whether there was one.
    pub fn remove(&mut self, key: &str) -> bool {
        let before = self.entries.len();
        self.entries.retain(|(k, _)| k != key);
        self.entries.len() != before
    }

    /// All entries in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Bytes)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Adds an entry whose key was already validated (by the frame decoder).
    pub(crate) fn push_unchecked(&mut self, key: String, value: Bytes) {
        self.entries.push((key, value));
    }
}

/// Whether `key` is a valid metadata key.
pub(crate) fn is_valid_key(key: &str) -> bool {
    !key.is_empty()
        && key.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'_' | b'.')
        })
}

impl fmt::Debug for MetadataMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.entries.iter().map(|(k, v)| (k, v)))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_keys_keep_order() {
        let mut md = MetadataMap::new();
        md.insert("k", "1");
        md.insert("k", "2");
        assert_eq!(md.get_str("k"), Some("1"));
        assert_eq!(md.get_all("k").collect::<Vec<_>>(), ["1", "2"]);
        assert!(md.remove("k"));
        assert!(md.is_empty());
    }

    #[test]
    #[should_panic(expected = "invalid metadata key")]
    fn uppercase_key_is_rejected() {
        MetadataMap::new().insert("X-Id", "1");
    }
}
