//! Test support: an `LD_PRELOAD` library that sets a process's wall clock
//! back by a number of seconds that a test changes while the process runs,
//! and leaves its monotonic clock alone. The clock test steps Envoy's wall
//! clock back under the filter this way (libfaketime does the same and more,
//! but hangs Envoy at start: its lazy set-up, first reached from tcmalloc's,
//! allocates).
//!
//! `WALL_CLOCK_SHIM_FILE` names a file of 8 bytes, a little-endian `i64`:
//! the seconds to set `CLOCK_REALTIME` (and `gettimeofday`) back by. It is
//! mapped shared and read on every call, so rewriting those 8 bytes in place
//! (not truncating the file) moves the clock at once. Without the variable,
//! or with a file that cannot be mapped, the clock is left as it is.
//!
//! Interposed calls read the kernel's clocks with the raw system calls and
//! never allocate or lock: they may run inside the allocator's own set-up.

#![cfg(target_os = "linux")]

use std::sync::atomic::{AtomicI64, AtomicPtr, AtomicU8, Ordering};

const FILE_VARIABLE: &[u8] = b"WALL_CLOCK_SHIM_FILE\0";

/// Not yet looked for, being mapped, mapped (or given up).
const UNMAPPED: u8 = 0;
const MAPPING: u8 = 1;
const SETTLED: u8 = 2;

static STATE: AtomicU8 = AtomicU8::new(UNMAPPED);
static OFFSET: AtomicPtr<AtomicI64> = AtomicPtr::new(std::ptr::null_mut());

/// The seconds the wall clock is set back by now (0 until mapped).
fn offset_secs() -> i64 {
    if STATE.load(Ordering::Acquire) == UNMAPPED
        && STATE
            .compare_exchange(UNMAPPED, MAPPING, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    {
        OFFSET.store(map_offset(), Ordering::Release);
        STATE.store(SETTLED, Ordering::Release);
    }
    let offset = OFFSET.load(Ordering::Acquire);
    if offset.is_null() {
        return 0;
    }
    // SAFETY: a live shared mapping of 8 bytes, page-aligned, never unmapped.
    unsafe { (*offset).load(Ordering::Relaxed) }
}

/// Maps the file `WALL_CLOCK_SHIM_FILE` names; null if it cannot.
fn map_offset() -> *mut AtomicI64 {
    // SAFETY: a NUL-terminated name; getenv, open, mmap and close neither
    // allocate nor read the clock.
    unsafe {
        let path = libc::getenv(FILE_VARIABLE.as_ptr().cast());
        if path.is_null() {
            return std::ptr::null_mut();
        }
        let fd = libc::open(path, libc::O_RDONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return std::ptr::null_mut();
        }
        let mapped = libc::mmap(
            std::ptr::null_mut(),
            std::mem::size_of::<i64>(),
            libc::PROT_READ,
            libc::MAP_SHARED,
            fd,
            0,
        );
        libc::close(fd);
        if mapped == libc::MAP_FAILED {
            return std::ptr::null_mut();
        }
        mapped.cast()
    }
}

/// `clock_gettime(2)`: the kernel's answer, `CLOCK_REALTIME` and
/// `CLOCK_REALTIME_COARSE` set back.
///
/// # Safety
/// As `clock_gettime`: `tp` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn clock_gettime(
    clock: libc::clockid_t,
    tp: *mut libc::timespec,
) -> libc::c_int {
    // SAFETY: the caller's arguments, passed on.
    let status = unsafe { libc::syscall(libc::SYS_clock_gettime, clock, tp) };
    if status == 0
        && !tp.is_null()
        && (clock == libc::CLOCK_REALTIME || clock == libc::CLOCK_REALTIME_COARSE)
    {
        // SAFETY: the kernel just wrote it.
        unsafe { (*tp).tv_sec -= offset_secs() };
    }
    status as libc::c_int
}

/// `gettimeofday(2)`, set back alike.
///
/// # Safety
/// As `gettimeofday`: `tv` null or valid for a write, `tz` null or valid.
#[no_mangle]
pub unsafe extern "C" fn gettimeofday(
    tv: *mut libc::timeval,
    tz: *mut libc::c_void,
) -> libc::c_int {
    // SAFETY: the caller's arguments, passed on.
    let status = unsafe { libc::syscall(libc::SYS_gettimeofday, tv, tz) };
    if status == 0 && !tv.is_null() {
        // SAFETY: the kernel just wrote it.
        unsafe { (*tv).tv_sec -= offset_secs() };
    }
    status as libc::c_int
}
