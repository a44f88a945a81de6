//! Group keys packed for many groups: each key in Arrow's row format, all of a
//! block's keys in one buffer, and a hash table of group numbers over them. A
//! group costs its key's bytes, four bytes for where its key ends and about
//! eight in the hash table, with no allocation of its own.

use std::hash::BuildHasher;

use hashbrown::{DefaultHashBuilder, HashTable};

use crate::StateError;

/// The hasher of every key table of an aggregation, so that a key hashed once
/// is looked up in the batch's table and in the committed one.
#[derive(Clone, Default)]
pub(crate) struct KeyHasher(DefaultHashBuilder);

impl KeyHasher {
    pub(crate) fn hash(&self, key: &[u8]) -> u64 {
        self.0.hash_one(key)
    }
}

/// The keys of a set of groups, numbered from 0 in the order they came.
#[derive(Clone, Default)]
pub(crate) struct Keys {
    bytes: Vec<u8>,
    /// Where each group's key ends in `bytes`; it starts where the one before
    /// it ends.
    ends: Vec<u32>,
    table: HashTable<u32>,
}

impl Keys {
    /// Room for `groups` groups of `bytes` bytes of keys in all.
    pub(crate) fn with_capacity(groups: usize, bytes: usize) -> Keys {
        Keys {
            bytes: Vec::with_capacity(bytes),
            ends: Vec::with_capacity(groups),
            table: HashTable::with_capacity(groups),
        }
    }

    /// Makes room for `groups` more groups of `bytes` bytes of keys in all,
    /// so that adding them does not grow the table step by step.
    pub(crate) fn reserve(&mut self, hasher: &KeyHasher, groups: usize, bytes: usize) {
        self.bytes.reserve(bytes);
        self.ends.reserve(groups);
        let Keys { bytes, ends, table } = self;
        table.reserve(groups, |&g| hasher.hash(key_of(bytes, ends, g)));
    }

    /// How many groups.
    pub(crate) fn len(&self) -> usize {
        self.ends.len()
    }

    /// Group `group`'s key.
    pub(crate) fn key(&self, group: u32) -> &[u8] {
        key_of(&self.bytes, &self.ends, group)
    }

    /// The group whose key is `key`, hashed to `hash` by the aggregation's
    /// [`KeyHasher`].
    pub(crate) fn find(&self, hash: u64, key: &[u8]) -> Option<u32> {
        self.table
            .find(hash, |&group| {
                same(key_of(&self.bytes, &self.ends, group), key)
            })
            .copied()
    }

    /// Whether `groups` more groups of `bytes` bytes of keys in all can be
    /// numbered and addressed.
    pub(crate) fn fits(&self, groups: usize, bytes: usize) -> bool {
        self.ends.len() + groups <= u32::MAX as usize
            && self.bytes.len() + bytes <= u32::MAX as usize
    }

    /// Adds `key`, which no group has, as the next group; its number.
    pub(crate) fn push(
        &mut self,
        hasher: &KeyHasher,
        hash: u64,
        key: &[u8],
    ) -> Result<u32, StateError> {
        if !self.fits(1, key.len()) {
            return Err(too_many());
        }
        Ok(self.push_fitting(hasher, hash, key))
    }

    /// [`Keys::push`], for a key that [`Keys::fits`] said fits.
    pub(crate) fn push_fitting(&mut self, hasher: &KeyHasher, hash: u64, key: &[u8]) -> u32 {
        let group = self.ends.len() as u32;
        self.bytes.extend_from_slice(key);
        self.ends.push(self.bytes.len() as u32);
        let Keys { bytes, ends, table } = self;
        table.insert_unique(hash, group, |&g| hasher.hash(key_of(bytes, ends, g)));
        group
    }

    /// The group whose key is `key`, added as the next group when no group
    /// has it (then `true`), in one probe of the table.
    pub(crate) fn find_or_push(
        &mut self,
        hasher: &KeyHasher,
        hash: u64,
        key: &[u8],
    ) -> Result<(u32, bool), StateError> {
        let Keys { bytes, ends, table } = self;
        let entry = table.entry(
            hash,
            |&g| same(key_of(bytes, ends, g), key),
            |&g| hasher.hash(key_of(bytes, ends, g)),
        );
        match entry {
            hashbrown::hash_table::Entry::Occupied(found) => Ok((*found.get(), false)),
            hashbrown::hash_table::Entry::Vacant(room) => {
                let group = ends.len() as u32;
                if ends.len() >= u32::MAX as usize || bytes.len() + key.len() > u32::MAX as usize {
                    return Err(too_many());
                }
                bytes.extend_from_slice(key);
                ends.push(bytes.len() as u32);
                room.insert(group);
                Ok((group, true))
            }
        }
    }

    /// Drops the groups numbered `len` and above, as if they had never come.
    pub(crate) fn truncate(&mut self, hasher: &KeyHasher, len: usize) {
        for group in (len..self.ends.len()).rev() {
            let group = group as u32;
            let hash = hasher.hash(self.key(group));
            if let Ok(found) = self.table.find_entry(hash, |&g| g == group) {
                found.remove();
            }
        }
        let end = if len == 0 {
            0
        } else {
            self.ends[len - 1] as usize
        };
        self.bytes.truncate(end);
        self.ends.truncate(len);
    }

    /// The bytes of the keys of groups `from` onwards.
    pub(crate) fn bytes_from(&self, from: usize) -> usize {
        let start = if from == 0 {
            0
        } else {
            self.ends[from - 1] as usize
        };
        self.bytes.len() - start
    }

    /// How many more groups the table takes before it grows.
    pub(crate) fn room(&self) -> usize {
        self.table.capacity() - self.table.len()
    }

    /// The keys in group order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &[u8]> {
        (0..self.ends.len() as u32).map(|g| self.key(g))
    }

    /// The bytes it holds in memory.
    pub(crate) fn memory_size(&self) -> usize {
        self.bytes.capacity()
            + self.ends.capacity() * size_of::<u32>()
            + self.table.allocation_size()
    }
}

/// Whether two keys are equal: most keys are a few columns of numbers, short
/// enough to compare in two loads each, where a call to `memcmp` would cost
/// more than the comparison.
#[inline]
fn same(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    let word =
        |s: &[u8], at: usize| u64::from_ne_bytes(s[at..at + 8].try_into().unwrap_or_default());
    let wide =
        |s: &[u8], at: usize| u128::from_ne_bytes(s[at..at + 16].try_into().unwrap_or_default());
    match n {
        // The first and the last eight (or sixteen) bytes, which overlap
        // when the key is shorter than both.
        8..=16 => word(a, 0) == word(b, 0) && word(a, n - 8) == word(b, n - 8),
        17..=32 => wide(a, 0) == wide(b, 0) && wide(a, n - 16) == wide(b, n - 16),
        _ => a == b,
    }
}

fn key_of<'a>(bytes: &'a [u8], ends: &[u32], group: u32) -> &'a [u8] {
    let group = group as usize;
    let start = if group == 0 {
        0
    } else {
        ends[group - 1] as usize
    };
    &bytes[start..ends[group] as usize]
}

/// A block's keys are numbered and addressed in 32 bits: 4 Gi groups, or 4 GiB
/// of keys, in one window, are more than any memory budget lets a query hold.
fn too_many() -> StateError {
    StateError::Internal("one window holds more than 4 GiB of group keys".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_found_by_their_bytes_and_numbered_in_order() {
        let hasher = KeyHasher::default();
        let mut keys = Keys::default();
        let words: Vec<String> = (0..10_000).map(|i| format!("key-{i}")).collect();
        for (i, word) in words.iter().enumerate() {
            let hash = hasher.hash(word.as_bytes());
            assert_eq!(keys.find(hash, word.as_bytes()), None);
            assert_eq!(keys.push(&hasher, hash, word.as_bytes()).unwrap(), i as u32);
        }
        // An empty key is a key too (a group of a single null, say).
        let empty = hasher.hash(b"");
        assert_eq!(keys.push(&hasher, empty, b"").unwrap(), 10_000);
        assert_eq!(keys.find(empty, b""), Some(10_000));
        for (i, word) in words.iter().enumerate() {
            assert_eq!(
                keys.find(hasher.hash(word.as_bytes()), word.as_bytes()),
                Some(i as u32)
            );
        }
        assert_eq!(keys.len(), 10_001);
        assert!(keys.iter().take(3).eq([&b"key-0"[..], b"key-1", b"key-2"]));
        assert_eq!(keys.find(hasher.hash(b"key-10000"), b"key-10000"), None);
    }

    #[test]
    fn keys_of_every_length_compare_by_every_byte() {
        for n in 0..40 {
            let a: Vec<u8> = (0..n as u8).collect();
            assert!(same(&a, &a.clone()), "{n}");
            for at in 0..n {
                let mut b = a.clone();
                b[at] ^= 0x40;
                assert!(!same(&a, &b), "{n} bytes, differing at {at}");
            }
            assert!(!same(&a, &a[..n.saturating_sub(1)]) || n == 0, "{n}");
        }
    }

    #[test]
    fn a_batch_s_keys_are_dropped_as_if_they_had_never_come() {
        let hasher = KeyHasher::default();
        let mut keys = Keys::default();
        let words: Vec<String> = (0..1000).map(|i| format!("key-{i}")).collect();
        for word in &words {
            let hash = hasher.hash(word.as_bytes());
            assert!(keys.find_or_push(&hasher, hash, word.as_bytes()).unwrap().1);
        }
        keys.truncate(&hasher, 400);
        assert_eq!(keys.len(), 400);
        assert_eq!(
            keys.bytes_from(0),
            words[..400].iter().map(String::len).sum::<usize>()
        );
        for (i, word) in words.iter().enumerate() {
            let found = keys.find(hasher.hash(word.as_bytes()), word.as_bytes());
            assert_eq!(found, (i < 400).then_some(i as u32), "{word}");
        }
        // Pushed again, they are numbered after the ones kept.
        let hash = hasher.hash(b"key-999");
        assert_eq!(
            keys.find_or_push(&hasher, hash, b"key-999").unwrap(),
            (400, true)
        );
        assert_eq!(
            keys.find_or_push(&hasher, hash, b"key-999").unwrap(),
            (400, false)
        );
    }
}
