//! Buffers whose first value starts a cache line.
//!
//! Why: an AMX tile load whose 64-byte rows straddle two cache lines is about seven times
//! slower than an aligned one (measured on a Xeon with AMX: ~48 cycles against ~7 per
//! 1 KiB tile), and a `Vec`'s allocation is only as aligned as its element (16 bytes mod
//! 64 was seen). Weight panels and activation tiles are sized in whole lines already; this
//! puts their start on a line too. AVX-512 loads of a panel gain the same way.

use std::fmt;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

/// Plain values: every bit pattern (all-zero included) is a valid value.
///
/// # Safety
/// Implementors have no padding, no invalid bit patterns and an alignment dividing 64.
pub unsafe trait Plain: Copy + Default + 'static {}
// SAFETY: integers and floats of at most 64 bytes' alignment, every bit pattern valid.
unsafe impl Plain for u16 {}
// SAFETY: as above.
unsafe impl Plain for u8 {}
// SAFETY: as above.
unsafe impl Plain for f32 {}

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// A growable buffer of `T` that starts on a 64-byte boundary.
pub struct AlignedVec<T: Plain> {
    lines: Vec<Line>,
    len: usize,
    _values: PhantomData<T>,
}

impl<T: Plain> AlignedVec<T> {
    pub const fn new() -> Self {
        AlignedVec {
            lines: Vec::new(),
            len: 0,
            _values: PhantomData,
        }
    }

    /// `len` zeros. Panics only where a `Vec` of that many values would (capacity overflow);
    /// callers size their buffers with checked arithmetic first.
    pub fn zeroed(len: usize) -> Self {
        let mut v = Self::new();
        v.set_len(len);
        v.fill(T::default());
        v
    }

    /// Makes the buffer `len` values long. Values kept from before stay; values beyond the
    /// earlier capacity are zero, others are whatever was there (callers that need zeros
    /// fill them): reused scratch is not cleared on every call.
    pub fn set_len(&mut self, len: usize) {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .expect("AlignedVec length overflows the address space");
        let lines = bytes.div_ceil(64);
        if lines > self.lines.len() {
            self.lines.resize(lines, Line([0; 64]));
        }
        self.len = len;
    }
}

impl<T: Plain> Default for AlignedVec<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Plain> Deref for AlignedVec<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `lines` holds at least `len · size_of::<T>()` initialised bytes, aligned to
        // 64 (≥ T's alignment), and every bit pattern is a valid `T` (`Plain`).
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr() as *const T, self.len) }
    }
}

impl<T: Plain> DerefMut for AlignedVec<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr() as *mut T, self.len) }
    }
}

impl<T: Plain> Clone for AlignedVec<T> {
    fn clone(&self) -> Self {
        AlignedVec {
            lines: self.lines.clone(),
            len: self.len,
            _values: PhantomData,
        }
    }
}

impl<T: Plain + PartialEq> PartialEq for AlignedVec<T> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl<T: Plain + fmt::Debug> fmt::Debug for AlignedVec<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_on_a_line_and_keeps_values_when_grown() {
        let mut v = AlignedVec::<u16>::zeroed(3);
        assert_eq!(v.as_ptr() as usize % 64, 0);
        assert_eq!(&v[..], &[0, 0, 0]);
        v[2] = 7;
        v.set_len(1000);
        assert_eq!(v.as_ptr() as usize % 64, 0);
        assert_eq!(v.len(), 1000);
        assert_eq!(v[2], 7);
        assert!(v[3..].iter().all(|&x| x == 0));
        v.set_len(2);
        assert_eq!(&v[..], &[0, 0]);
        let f = AlignedVec::<f32>::zeroed(17);
        assert_eq!(f.as_ptr() as usize % 64, 0);
        assert_eq!(f.clone(), f);
    }

    #[test]
    fn empty_buffers_are_empty_slices() {
        let v = AlignedVec::<f32>::new();
        assert!(v.is_empty());
        assert_eq!(AlignedVec::<u16>::zeroed(0).len(), 0);
    }
}
