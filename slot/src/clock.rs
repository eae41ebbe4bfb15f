//! Timestamps for the hot path, in `CLOCK_MONOTONIC` nanoseconds.
//!
//! The agent compares slot timestamps with its own `CLOCK_MONOTONIC` reading
//! (a system-wide clock), so the client must write that same clock. Reading
//! it through the vDSO costs about 20 ns on the reference machine (AMD EPYC,
//! clocksource `tsc`), which alone would eat the whole 20 ns budget of a
//! section open. A raw `rdtsc` costs about 9 ns, so on x86_64 with an
//! invariant TSC (`constant_tsc` + `nonstop_tsc`) and the kernel itself using
//! `tsc` as clocksource, we read the TSC and convert it with a linear fit
//! (`ns = base_ns + (tsc - base_tsc) * mult >> 32`) anchored on
//! `CLOCK_MONOTONIC`. The fit is refreshed by [`recalibrate`] (the client's
//! background thread calls it every second), which follows NTP slewing of
//! `CLOCK_MONOTONIC` to within microseconds. Anywhere else, or with
//! `WARDEN_CLOCK=clock_gettime`, we call `clock_gettime(CLOCK_MONOTONIC)`.
//!
//! `CLOCK_MONOTONIC_COARSE` (3 ns) was rejected: its 4 ms resolution is too
//! coarse for per-section durations of a few milliseconds.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};

/// Which source [`now_ns`] reads; decided once, on first use.
static MODE: AtomicU8 = AtomicU8::new(MODE_UNINIT);
const MODE_UNINIT: u8 = 0;
const MODE_TSC: u8 = 1;
const MODE_SYSCALL: u8 = 2;

/// One linear fit from TSC ticks to monotonic nanoseconds.
///
/// Fields are atomics so a fit being rewritten is never UB to read; a ring
/// of four means a reader would need to stall across four recalibrations
/// (seconds) to read a half-written fit, which at worst yields one wrong
/// timestamp.
struct Fit {
    tsc: AtomicU64,
    ns: AtomicU64,
    /// Nanoseconds per tick, as a 32.32 fixed-point number.
    mult: AtomicU64,
}

const FITS: usize = 4;
#[allow(clippy::declare_interior_mutable_const)]
const EMPTY_FIT: Fit = Fit {
    tsc: AtomicU64::new(0),
    ns: AtomicU64::new(0),
    mult: AtomicU64::new(0),
};
static FIT: [Fit; FITS] = [EMPTY_FIT; FITS];
static CURRENT_FIT: AtomicUsize = AtomicUsize::new(0);

/// The first calibration point: a long baseline for the slope.
static ORIGIN: Mutex<Option<(u64, u64)>> = Mutex::new(None);

/// The monotonic clock the slot timestamps use, in nanoseconds.
///
/// Why not `std::time::Instant`: its value is opaque, and the agent needs a
/// number it can compare with its own `CLOCK_MONOTONIC` reading.
#[inline]
pub fn now_ns() -> u64 {
    match MODE.load(Ordering::Relaxed) {
        MODE_TSC => tsc_now(),
        MODE_SYSCALL => syscall_now(),
        _ => {
            init();
            if MODE.load(Ordering::Relaxed) == MODE_TSC {
                tsc_now()
            } else {
                syscall_now()
            }
        }
    }
}

/// Name of the source in use ("tsc" or "clock_gettime"), for logs and benchmarks.
pub fn source() -> &'static str {
    init();
    if MODE.load(Ordering::Relaxed) == MODE_TSC {
        "tsc"
    } else {
        "clock_gettime"
    }
}

/// `clock_gettime(CLOCK_MONOTONIC)` in nanoseconds.
pub fn syscall_now() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(ts.tv_nsec as u64)
}

#[inline]
fn tsc_now() -> u64 {
    let fit = &FIT[CURRENT_FIT.load(Ordering::Acquire) % FITS];
    let base_tsc = fit.tsc.load(Ordering::Relaxed);
    let base_ns = fit.ns.load(Ordering::Relaxed);
    let mult = fit.mult.load(Ordering::Relaxed);
    let dt = rdtsc().saturating_sub(base_tsc);
    base_ns.wrapping_add(((u128::from(dt) * u128::from(mult)) >> 32) as u64)
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn rdtsc() -> u64 {
    // SAFETY: rdtsc is available on every x86_64 CPU and has no memory effects.
    #[allow(unused_unsafe)]
    unsafe {
        core::arch::x86_64::_rdtsc()
    }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn rdtsc() -> u64 {
    0
}

/// A (tsc, ns) pair taken as close together as we can: the tightest of a few tries.
fn sample_pair() -> (u64, u64) {
    let mut best = (u64::MAX, 0, 0);
    for _ in 0..5 {
        let t0 = rdtsc();
        let ns = syscall_now();
        let t1 = rdtsc();
        let width = t1.wrapping_sub(t0);
        if width < best.0 {
            best = (width, t0 + width / 2, ns);
        }
    }
    (best.1, best.2)
}

fn tsc_usable() -> bool {
    if !cfg!(target_arch = "x86_64") {
        return false;
    }
    if std::env::var("WARDEN_CLOCK").is_ok_and(|v| v == "clock_gettime") {
        return false;
    }
    let clocksource =
        std::fs::read_to_string("/sys/devices/system/clocksource/clocksource0/current_clocksource")
            .unwrap_or_default();
    if clocksource.trim() != "tsc" {
        return false;
    }
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags = cpuinfo
        .lines()
        .find(|l| l.starts_with("flags"))
        .unwrap_or_default();
    let has = |f: &str| flags.split_whitespace().any(|w| w == f);
    has("constant_tsc") && has("nonstop_tsc")
}

/// Decides the clock source once (a 5 ms calibration when the TSC is used).
fn init() {
    if MODE.load(Ordering::Acquire) != MODE_UNINIT {
        return;
    }
    let mut origin = match ORIGIN.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    };
    if MODE.load(Ordering::Acquire) != MODE_UNINIT {
        return;
    }
    if !tsc_usable() {
        MODE.store(MODE_SYSCALL, Ordering::Release);
        return;
    }
    let first = sample_pair();
    std::thread::sleep(std::time::Duration::from_millis(5));
    let second = sample_pair();
    match slope(first, second) {
        Some(mult) => {
            publish(second, mult);
            *origin = Some(first);
            MODE.store(MODE_TSC, Ordering::Release);
        }
        None => MODE.store(MODE_SYSCALL, Ordering::Release),
    }
}

/// 32.32 fixed-point nanoseconds per tick between two pairs, if sane (0.05..20 GHz).
fn slope(a: (u64, u64), b: (u64, u64)) -> Option<u64> {
    let dt = b.0.checked_sub(a.0)?;
    let dn = b.1.checked_sub(a.1)?;
    if dt == 0 || dn == 0 {
        return None;
    }
    let mult = (u128::from(dn) << 32) / u128::from(dt);
    let ns_per_tick = mult as f64 / 4_294_967_296.0;
    (0.05..=20.0).contains(&ns_per_tick).then_some(mult as u64)
}

fn publish(anchor: (u64, u64), mult: u64) {
    let next = (CURRENT_FIT.load(Ordering::Relaxed) + 1) % FITS;
    let fit = &FIT[next];
    fit.tsc.store(anchor.0, Ordering::Relaxed);
    fit.ns.store(anchor.1, Ordering::Relaxed);
    fit.mult.store(mult, Ordering::Relaxed);
    CURRENT_FIT.store(next, Ordering::Release);
}

/// Refreshes the TSC fit: slope over the whole time since start, anchored now.
///
/// Why: `CLOCK_MONOTONIC` is slewed by NTP, so a fixed fit would drift by up
/// to 500 ppm; refitting every second keeps the error in microseconds. Cheap
/// (a few clock reads), called from the client's background thread, never
/// from the hot path. A no-op when the TSC is not in use.
pub fn recalibrate() {
    if MODE.load(Ordering::Acquire) != MODE_TSC {
        return;
    }
    let origin = match ORIGIN.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    };
    let Some(first) = *origin else { return };
    let now = sample_pair();
    if let Some(mult) = slope(first, now) {
        publish(now, mult);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracks_clock_monotonic() {
        let _ = now_ns();
        recalibrate();
        for _ in 0..100 {
            let a = syscall_now();
            let b = now_ns();
            let c = syscall_now();
            // Within 50 us of the real clock, whichever source is in use.
            assert!(
                b + 50_000 >= a && b <= c + 50_000,
                "{a} {b} {c} ({})",
                source()
            );
        }
    }

    #[test]
    fn slope_rejects_nonsense() {
        assert_eq!(slope((10, 10), (10, 20)), None);
        assert_eq!(slope((10, 10), (5, 20)), None);
        assert!(slope((0, 0), (1000, 400)).is_some());
    }
}
