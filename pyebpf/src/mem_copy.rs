//! Byte copies for the static (musl) binary's `memcpy` and `memmove`.
//!
//! musl's x86-64 `memcpy` is `rep movsq` at every size, whose start-up costs tens of cycles;
//! pyebpf's copies are mostly small (a sample takes about 20, of 4 to 600 bytes, between the ring
//! buffer and the aggregated profile), so the shipped binary spent a tenth of its CPU in `memcpy`
//! where the glibc build spends under half that. Copies of up to 128 bytes here are loads into
//! registers then stores (which also makes them safe for overlapping ranges); longer ones are
//! `rep movsb`, fast on the CPUs that advertise `erms`.
//!
//! Nothing here may compile to a call of `memcpy` or `memmove` (it is what they call): every
//! copy is of a size known when compiling, or inline assembly.

use std::ptr::{read_unaligned as load, write_unaligned as store};

/// Copies `n` bytes from `src` to `dest`; the ranges may overlap.
///
/// # Safety
/// `src` is valid for reads and `dest` for writes of `n` bytes.
#[inline(always)]
pub unsafe fn copy_bytes(dest: *mut u8, src: *const u8, n: usize) {
    // SAFETY: every access below lies within the first `n` bytes of its range,
    // as the caller guarantees valid; all loads come before any store.
    unsafe {
        match n {
            0..=16 => copy_small(dest, src, n),
            17..=32 => {
                let (a, b) = (load16(src, 0), load16(src, n - 16));
                store16(dest, 0, a);
                store16(dest, n - 16, b);
            }
            33..=64 => {
                let (a, b) = (load16(src, 0), load16(src, 16));
                let (c, d) = (load16(src, n - 32), load16(src, n - 16));
                store16(dest, 0, a);
                store16(dest, 16, b);
                store16(dest, n - 32, c);
                store16(dest, n - 16, d);
            }
            65..=128 => {
                let (a, b, c, d) = (load16(src, 0), load16(src, 16), load16(src, 32), load16(src, 48));
                let (e, f, g, h) = (load16(src, n - 64), load16(src, n - 48), load16(src, n - 32), load16(src, n - 16));
                store16(dest, 0, a);
                store16(dest, 16, b);
                store16(dest, 32, c);
                store16(dest, 48, d);
                store16(dest, n - 64, e);
                store16(dest, n - 48, f);
                store16(dest, n - 32, g);
                store16(dest, n - 16, h);
            }
            _ => copy_large(dest, src, n),
        }
    }
}

// Single 16-byte words, never arrays: LLVM may fold an array's load and store into one `memcpy`
// or `memmove` of the whole, which is this very function.
#[inline(always)]
unsafe fn load16(src: *const u8, at: usize) -> u128 {
    // SAFETY: the caller reads within its valid range.
    unsafe { load(src.add(at).cast()) }
}

#[inline(always)]
unsafe fn store16(dest: *mut u8, at: usize, value: u128) {
    // SAFETY: the caller writes within its valid range.
    unsafe { store(dest.add(at).cast(), value) }
}

/// Up to 16 bytes, as two possibly overlapping words (or three bytes).
#[inline(always)]
unsafe fn copy_small(dest: *mut u8, src: *const u8, n: usize) {
    // SAFETY: as copy_bytes; every offset is below `n`.
    unsafe {
        if n >= 8 {
            let (a, b): (u64, u64) = (load(src.cast()), load(src.add(n - 8).cast()));
            store(dest.cast(), a);
            store(dest.add(n - 8).cast(), b);
        } else if n >= 4 {
            let (a, b): (u32, u32) = (load(src.cast()), load(src.add(n - 4).cast()));
            store(dest.cast(), a);
            store(dest.add(n - 4).cast(), b);
        } else if n > 0 {
            let (a, b, c) = (*src, *src.add(n / 2), *src.add(n - 1));
            *dest = a;
            *dest.add(n / 2) = b;
            *dest.add(n - 1) = c;
        }
    }
}

/// More than 128 bytes: forwards, unless `dest` starts inside the source (then backwards, so no
/// byte is overwritten before it is read).
#[inline(never)]
unsafe fn copy_large(dest: *mut u8, src: *const u8, n: usize) {
    // SAFETY: `rep movsb` copies `rcx` bytes between the ranges the caller guarantees valid; the
    // direction flag is set only for the backward copy and cleared right after it, as the ABI
    // requires at every call and return.
    unsafe {
        if (dest as usize).wrapping_sub(src as usize) >= n {
            std::arch::asm!("rep movsb", inout("rcx") n => _, inout("rdi") dest => _, inout("rsi") src => _, options(nostack, preserves_flags));
        } else {
            std::arch::asm!(
                "std", "rep movsb", "cld",
                inout("rcx") n => _, inout("rdi") dest.add(n - 1) => _, inout("rsi") src.add(n - 1) => _,
                options(nostack)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::copy_bytes;

    /// Every length up to 600 (each branch and its edges), forwards and backwards over the same
    /// buffer at distances from 1 byte, and between separate buffers, against `copy_within`.
    #[test]
    fn copies_like_memmove_at_every_length_and_overlap() {
        let pattern: Vec<u8> = (0..2048u32).map(|i| (i.wrapping_mul(2654435761) >> 24) as u8).collect();
        for n in 0..=600 {
            for (from, to) in [(0, 0), (100, 0), (0, 100), (700, 699), (699, 700), (3, 40), (40, 3), (1, 1 + n / 2), (1 + n / 2, 1), (0, 1000)] {
                let mut expected = pattern.clone();
                expected.copy_within(from..from + n, to);
                let mut got = pattern.clone();
                // SAFETY: both ranges lie within `got` (from, to + n <= 2048).
                unsafe { copy_bytes(got.as_mut_ptr().add(to), got.as_ptr().add(from), n) };
                assert!(got == expected, "{n} bytes from {from} to {to}");
            }
            let source = &pattern[5..5 + n];
            let mut separate = vec![0u8; n + 3];
            // SAFETY: `separate` holds n + 3 bytes and `source` n.
            unsafe { copy_bytes(separate.as_mut_ptr().add(3), source.as_ptr(), n) };
            assert_eq!(&separate[3..], source, "{n} bytes between buffers");
            assert_eq!(&separate[..3], &[0, 0, 0], "{n} bytes: nothing written before the destination");
        }
    }
}
