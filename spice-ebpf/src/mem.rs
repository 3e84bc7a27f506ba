//! Stores that stay stores. In these programs an array literal (`[0u64; 2]`), a struct
//! assigned through a pointer (`(*p).hdr = *hdr`) or runs of zero stores to adjacent fields
//! compiled to a BPF-to-BPF call of the object's `memset` or `memmove` (compiler_builtins'
//! generic versions, which bpf-linker links in and which move one byte per loop pass: a
//! 16-byte buffer costs a call and 16 passes of 4 instructions; `llvm-objdump -d -r` of the
//! object showed `call memset` with `r3 = 16` in the element loop's step and `call memmove`
//! with `r3 = 24` in `spice_emit_message`, once per message). Volatile stores cannot be
//! merged back into such a call.
//!
//! Only the message record's header is copied with [`copy_words`]; the rarer records' headers
//! are still assigned. A first version that also copied every other record's header as words
//! and wrote the call's `EmitCtx` field by field counted nothing on Debian's 6.1 kernel (the
//! guest matrix, `cargo xtask guest --kernel 6.1`), while 6.18 framed exactly. Which of those
//! changes 6.1 could not take was not isolated; this one passes there.

use core::mem::MaybeUninit;

/// `N` zero words in `w` (a stack buffer), one store each; returns the initialised array.
#[inline(always)]
pub fn zero_words<const N: usize>(w: &mut MaybeUninit<[u64; N]>) -> &mut [u64; N] {
    let p = w.as_mut_ptr() as *mut u64;
    for i in 0..N {
        // SAFETY: word i of the array.
        unsafe { core::ptr::write_volatile(p.add(i), 0) };
    }
    // SAFETY: every word was just written.
    unsafe { w.assume_init_mut() }
}

/// Zeroes the `N` bytes at `dst` (a padding or address field of a record being written),
/// one store each.
///
/// # Safety
/// `dst` is valid for writes of `N` bytes (alignment 1).
#[inline(always)]
pub unsafe fn zero_bytes<const N: usize>(dst: *mut [u8; N]) {
    let p = dst as *mut u8;
    for i in 0..N {
        // SAFETY: byte i of the array the caller vouches for.
        unsafe { core::ptr::write_volatile(p.add(i), 0) };
    }
}

/// Sets r0 to 0 as the last act of a subprogram that returns nothing. The verifier refuses
/// a subprogram whose r0 holds a stack pointer at its exit ("cannot return stack pointer to
/// the caller", `prepare_func_exit` in kernel/bpf/verifier.c), and a void function's r0 is a
/// free register to LLVM: `on_moved` once left its caller's `call` pointer there and
/// `spice_sys_exit` was refused on 6.18. A return value does not help: LLVM drops one that
/// no caller uses, or that is a constant. The asm has no `nomem`, so it stays after every
/// store of the function.
#[inline(always)]
pub fn scalar_r0() {
    // SAFETY: writes r0 only, which is declared clobbered.
    unsafe { core::arch::asm!("r0 = 0", out("r0") _, options(nostack, preserves_flags)) };
}

/// Copies `v` to `dst` word by word, volatile. `T` is whole 8-byte words and aligned to 8
/// (asserted at compile time).
///
/// # Safety
/// `dst` is valid for writes of a `T` and aligned for it.
#[inline(always)]
pub unsafe fn copy_words<T: Copy>(v: &T, dst: *mut T) {
    const { assert!(core::mem::size_of::<T>() % 8 == 0 && core::mem::align_of::<T>() >= 8) };
    let (src, dst) = (v as *const T as *const u64, dst as *mut u64);
    for i in 0..core::mem::size_of::<T>() / 8 {
        // SAFETY: word i of two `T`s of whole words, both aligned to 8 (`v` is a reference,
        // `dst` as the caller vouches).
        unsafe { core::ptr::write_volatile(dst.add(i), core::ptr::read_volatile(src.add(i))) };
    }
}
