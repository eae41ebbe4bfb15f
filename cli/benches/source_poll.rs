//! Health-source costs, side by side in one run:
//!
//! 1. CPU time of one full poll of 8 GPUs by the NVML source, through the
//!    stand-in libnvidia-ml the tests build (tests/nvml_stub), next to one
//!    poll of the simulated source with 8 GPUs and one poll of the host
//!    memory source. The stub reads its scripted state once here
//!    (`NVML_STUB_CACHE`), so the NVML figure is the agent's work plus the
//!    stub's trivial answers; a real driver's calls (ioctls) cost more.
//! 2. The resident memory of the real `wardend` at idle (embedded defaults
//!    but for the socket), and while simulating an 8-GPU node.
//!
//! 3. On a machine with a GPU, `WARDEN_BENCH_NVML=libnvidia-ml.so.1` adds
//!    the same poll through the real driver (every GPU it has), in the same
//!    run as the stand-in, and the resident memory of wardend reading it.
//!
//! Run: `cargo bench -p warden-cli --bench source_poll` (release build).
//! Prints markdown for docs/benchmarks.md.

// A benchmark program: failing loudly on set-up errors is what it should do.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime};

use warden_agent::config::HostConfig;
use warden_agent::sources::Source;
use warden_agent::sources::dcgm::{DcgmConfig, DcgmSource};
use warden_agent::sources::host_memory::HostMemory;
use warden_agent::sources::nvml::{NvmlConfig, NvmlSource};
use warden_agent::sources::simulated::{SimScenario, Simulated};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid, writable timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// CPU time per poll: (median, p99) over `n` polls after a warm-up.
fn measure(source: &mut dyn Source, n: usize) -> (Duration, Duration, usize) {
    let mut reports = 0;
    for _ in 0..5 {
        reports = source.poll(SystemTime::now()).reports.len();
    }
    let mut samples: Vec<Duration> = (0..n)
        .map(|_| {
            let t0 = thread_cpu();
            let p = source.poll(SystemTime::now());
            let dt = thread_cpu() - t0;
            reports = p.reports.len();
            dt
        })
        .collect();
    samples.sort();
    (samples[n / 2], samples[n * 99 / 100], reports)
}

/// CPU time of process `pid`'s main thread so far, in nanoseconds
/// (schedstat: finer than the 10 ms ticks of /proc/PID/stat).
fn proc_cpu(pid: u32) -> Duration {
    let s = std::fs::read_to_string(format!("/proc/{pid}/schedstat")).unwrap();
    Duration::from_nanos(s.split_whitespace().next().unwrap().parse().unwrap())
}

fn us(d: Duration) -> String {
    format!("{:.1} us", d.as_secs_f64() * 1e6)
}

fn build_stub(dir: &Path) -> PathBuf {
    let lib = dir.join("libnvidia-ml.so.1");
    let out = Command::new("cc")
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(&lib)
        .arg(repo().join("tests/nvml_stub/nvml_stub.c"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    lib
}

fn rss_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap()
}

/// Starts wardend with `args`, waits for READY=1 and `settle`, returns its RSS.
fn wardend_rss(dir: &Path, args: &[&str], settle: Duration) -> u64 {
    let cfg = dir.join("rss.toml");
    std::fs::write(
        &cfg,
        format!(
            "[api]\nsocket = \"{}\"\n[metrics]\nlisten = \"127.0.0.1:0\"\n[agent]\nstate_dir = \"{}\"\n",
            dir.join("w.sock").display(),
            dir.join("state").display()
        ),
    )
    .unwrap();
    let notify = dir.join("notify");
    let _ = std::fs::remove_file(&notify);
    let sock = UnixDatagram::bind(&notify).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_wardend"))
        .arg("--config")
        .arg(&cfg)
        .args(args)
        .env("NOTIFY_SOCKET", &notify)
        .env("RUST_LOG", "error")
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut buf = [0u8; 512];
    loop {
        let n = sock.recv(&mut buf).expect("wardend did not get ready");
        if String::from_utf8_lossy(&buf[..n]).contains("READY=1") {
            break;
        }
    }
    std::thread::sleep(settle);
    let rss = rss_kib(child.id());
    let _ = child.kill();
    let _ = child.wait();
    rss
}

fn main() {
    let quick = !std::env::args().any(|a| a == "--bench");
    let n = if quick { 50 } else { 1000 };
    let dir = tempfile::tempdir().unwrap();
    let lib = build_stub(dir.path());
    let state = dir.path().join("nvml.state");
    let mut text = String::from("count=8\n");
    for g in 0..8 {
        text.push_str(&format!(
            "gpu{g}.nvlinks=4\ngpu{g}.temp=60\ngpu{g}.power_mw=300000\n"
        ));
    }
    std::fs::write(&state, text).unwrap();
    // SAFETY: single-threaded at this point. NVML_STUB_CACHE: the stub reads
    // its (unchanging) state once, so the figure is the agent's own work.
    unsafe {
        std::env::set_var("NVML_STUB_STATE", &state);
        std::env::set_var("NVML_STUB_CACHE", "1");
    }

    let mut nvml = NvmlSource::new(NvmlConfig {
        library: lib.display().to_string(),
        expected_gpus: 8,
        ..NvmlConfig::default()
    });
    let (nvml_med, nvml_p99, nvml_reports) = measure(&mut nvml, n);
    // The real driver, when asked for: as many GPUs as it has (the
    // `expected_gpus` check is not what is timed).
    let real = std::env::var("WARDEN_BENCH_NVML").ok().map(|library| {
        let mut src = NvmlSource::new(NvmlConfig {
            library: library.clone(),
            ..NvmlConfig::default()
        });
        let (med, p99, reports) = measure(&mut src, n);
        (library, med, p99, reports)
    });
    let scenario =
        SimScenario::from_file(&repo().join("examples/scenarios/healthy-8gpu.toml")).unwrap();
    let mut sim = Simulated::new(scenario, None);
    let (sim_med, sim_p99, sim_reports) = measure(&mut sim, n);
    let mut host = HostMemory::new(HostConfig::default());
    let (host_med, host_p99, _) = measure(&mut host, n);

    // DCGM: the stand-in libdcgm with 8 GPUs and one incident, loaded by
    // the real helper process (wardend --dcgm-helper); CPU counted on both
    // sides of the pipe.
    let dcgm_lib = dir.path().join("libdcgm.so.4");
    let out = Command::new("cc")
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(&dcgm_lib)
        .arg(repo().join("tests/dcgm_stub/dcgm_stub.c"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dcgm_state = dir.path().join("dcgm.state");
    std::fs::write(
        &dcgm_state,
        "gpus 0 1 2 3 4 5 6 7\nconnect ok\nversion 5\ncheck ok\nincident 1 3 0x80 10 10 Clocks throttled for thermal reasons on GPU 3\n",
    )
    .unwrap();
    // SAFETY: still single-threaded (the sources above poll on this thread).
    unsafe {
        std::env::set_var("DCGM_STUB_STATE", &dcgm_state);
        std::env::set_var(
            warden_agent::sources::dcgm::HELPER_ENV,
            env!("CARGO_BIN_EXE_wardend"),
        );
    }
    let mut dcgm = DcgmSource::new(
        DcgmConfig {
            library: dcgm_lib.display().to_string(),
            ..DcgmConfig::default()
        },
        true,
    );
    let (dcgm_med, dcgm_p99, dcgm_reports) = measure(&mut dcgm, n.min(200));
    let helper = dcgm.helper_pid().unwrap();
    let before = proc_cpu(helper);
    let t0 = thread_cpu();
    for _ in 0..n.min(200) {
        dcgm.poll(SystemTime::now());
    }
    let agent_side = (thread_cpu() - t0) / n.min(200) as u32;
    let helper_side = (proc_cpu(helper) - before) / n.min(200) as u32;

    let settle = Duration::from_secs(if quick { 1 } else { 3 });
    let idle = wardend_rss(dir.path(), &[], settle);
    let sim8 = wardend_rss(
        dir.path(),
        &[
            "--simulate",
            &repo()
                .join("examples/scenarios/healthy-8gpu.toml")
                .display()
                .to_string(),
        ],
        settle,
    );

    println!("## One poll, CPU time ({n} polls each, median / p99)");
    println!("| source | components reported | median | p99 |");
    println!("|---|---|---|---|");
    println!(
        "| NVML, 8 GPUs through the stand-in libnvidia-ml (the stub reads its scripted state once) | {nvml_reports} | {} | {} |",
        us(nvml_med),
        us(nvml_p99)
    );
    if let Some((library, med, p99, reports)) = &real {
        println!(
            "| NVML through the real driver ({library}), every GPU it has | {reports} | {} | {} |",
            us(*med),
            us(*p99)
        );
    }
    println!(
        "| simulated source, 8 GPUs (healthy-8gpu.toml) | {sim_reports} | {} | {} |",
        us(sim_med),
        us(sim_p99)
    );
    println!(
        "| host memory (/proc/meminfo) | 1 | {} | {} |",
        us(host_med),
        us(host_p99)
    );
    println!(
        "| DCGM, 8 GPUs through the stand-in libdcgm: agent side (request, answer, judging) | {dcgm_reports} | {} | {} |",
        us(dcgm_med),
        us(dcgm_p99)
    );
    println!(
        "| DCGM, mean per poll: agent side + helper process (the library call, the 1 MiB response parsed) | {dcgm_reports} | {} + {} | |",
        us(agent_side),
        us(helper_side)
    );
    println!();
    println!("## wardend resident memory");
    println!("| agent | RSS |");
    println!("|---|---|");
    // NVML is on by default: where the driver is, the idle agent reads it.
    let nvml_state = if real.is_some() {
        "NVML reading the real driver"
    } else {
        "NVML absent"
    };
    println!(
        "| idle, defaults ({nvml_state}, kmsg, host, TPU sources running) | {:.1} MiB |",
        idle as f64 / 1024.0
    );
    println!(
        "| simulating an 8-GPU node | {:.1} MiB |",
        sim8 as f64 / 1024.0
    );
}
