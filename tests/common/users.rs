//! Real unprivileged users for the security tests, and a way to run attack
//! code as them in a real process.
//!
//! In: a test running as root (as CI does). Out: a socket group
//! ([`SOCK_GROUP`]), a user in it ([`MEMBER`]) and a user not in it
//! ([`STRANGER`]), created once per machine with groupadd/useradd (system
//! accounts, no home, nologin), and [`run_as`], which re-executes this very
//! test binary as one of them with [`ATTACK_VAR`] naming an attack; the test
//! crate's `#[test] fn attacker()` calls [`dispatch`], which runs the attack
//! and prints one JSON line ([`RESULT_PREFIX`]) that [`run_as`] hands back.
//! Never: changes an account it did not create the same way (an existing
//! account of the same name is used as it is, its groups completed), or
//! runs attack code in the test's own (root) process.
//!
//! Adding an attack is one line in the test crate's table:
//! `("area.what", area::what)`, where `what(&args) -> serde_json::Value`.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use nix::unistd::{Gid, Group, Uid, User};

/// The group that may connect to the agent's socket in these tests.
pub const SOCK_GROUP: &str = "warden-t-sock";
/// A user in [`SOCK_GROUP`]: what a training user of the node is.
pub const MEMBER: &str = "warden-t-member";
/// A user not in [`SOCK_GROUP`]: any other local user.
pub const STRANGER: &str = "warden-t-stranger";

/// The variable naming the attack a re-executed test binary runs.
pub const ATTACK_VAR: &str = "WARDEN_ATTACK";
/// The variable carrying the attack's arguments, as JSON.
pub const ARGS_VAR: &str = "WARDEN_ATTACK_ARGS";
/// The prefix of the one stdout line holding an attack's result.
pub const RESULT_PREFIX: &str = "WARDEN-ATTACK-RESULT ";

/// One account the tests run code as.
#[derive(Debug, Clone)]
pub struct Ident {
    /// Its login name.
    pub name: String,
    /// Its uid.
    pub uid: u32,
    /// Its primary gid.
    pub gid: u32,
    /// Its supplementary groups (what `id -G` lists besides the primary).
    pub groups: Vec<u32>,
}

/// The accounts of the security tests.
#[derive(Debug)]
pub struct Users {
    /// The gid of [`SOCK_GROUP`].
    pub sock_gid: u32,
    /// [`MEMBER`].
    pub member: Ident,
    /// [`STRANGER`].
    pub stranger: Ident,
}

/// The accounts, created on first use (once per process; once per machine
/// under a file lock, so test processes racing each other are safe).
/// Panics, saying why, when the test is not root or an account cannot be
/// made.
pub fn users() -> &'static Users {
    static USERS: OnceLock<Users> = OnceLock::new();
    USERS.get_or_init(|| {
        assert!(
            Uid::effective().is_root(),
            "the security tests need root: they create the users {MEMBER} and {STRANGER} \
             and the group {SOCK_GROUP} (useradd/groupadd) and start wardend as root; \
             run them as root (CI does), e.g. `sudo -E cargo test -p warden-cli --test security`"
        );
        let _lock = Lock::take();
        let sock_gid = ensure_group(SOCK_GROUP);
        let member = ensure_user(MEMBER, Some(SOCK_GROUP));
        let stranger = ensure_user(STRANGER, None);
        assert!(
            !stranger.groups.contains(&sock_gid) && stranger.gid != sock_gid,
            "{STRANGER} is in {SOCK_GROUP}: remove it (gpasswd -d {STRANGER} {SOCK_GROUP})"
        );
        Users {
            sock_gid,
            member,
            stranger,
        }
    })
}

/// An exclusive flock held while accounts are looked up and made.
struct Lock(#[allow(dead_code)] nix::fcntl::Flock<std::fs::File>);

impl Lock {
    fn take() -> Self {
        use std::os::unix::fs::OpenOptionsExt;
        // /run is root's; /tmp is anyone's (a planted symlink is not followed).
        let dir = if Path::new("/run").is_dir() {
            PathBuf::from("/run")
        } else {
            std::env::temp_dir()
        };
        let path = dir.join("warden-test-users.lock");
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .unwrap_or_else(|e| panic!("open the lock file {}: {e}", path.display()));
        // Held as long as the descriptor: released when `Lock` goes.
        let held = nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive)
            .unwrap_or_else(|(_, e)| panic!("lock {}: {e}", path.display()));
        Self(held)
    }
}

fn tool(args: &[&str]) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("run {args:?}: {e} (the security tests need shadow's useradd)"));
    assert!(
        out.status.success(),
        "{args:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

fn ensure_group(name: &str) -> u32 {
    if let Some(g) = Group::from_name(name).expect("look up a group") {
        return g.gid.as_raw();
    }
    tool(&["groupadd", "--system", name]);
    Group::from_name(name)
        .expect("look up a group")
        .unwrap_or_else(|| panic!("groupadd made no group {name}"))
        .gid
        .as_raw()
}

fn nologin() -> &'static str {
    ["/usr/sbin/nologin", "/sbin/nologin", "/bin/false"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .unwrap_or("/bin/false")
}

fn ensure_user(name: &str, extra_group: Option<&str>) -> Ident {
    if User::from_name(name).expect("look up a user").is_none() {
        let mut args = vec![
            "useradd",
            "--system",
            "--no-create-home",
            "--home-dir",
            "/nonexistent",
            "--shell",
            nologin(),
            "--user-group",
        ];
        if let Some(g) = extra_group {
            args.extend(["--groups", g]);
        }
        args.push(name);
        tool(&args);
    }
    let user = User::from_name(name)
        .expect("look up a user")
        .unwrap_or_else(|| panic!("useradd made no user {name}"));
    let cname = std::ffi::CString::new(name).expect("a name without NUL");
    let mut groups: Vec<u32> = nix::unistd::getgrouplist(&cname, user.gid)
        .expect("the user's groups")
        .into_iter()
        .map(Gid::as_raw)
        .collect();
    if let Some(g) = extra_group {
        let gid = ensure_group(g);
        if !groups.contains(&gid) {
            tool(&["usermod", "--append", "--groups", g, name]);
            groups.push(gid);
        }
    }
    groups.retain(|g| *g != user.gid.as_raw());
    Ident {
        name: name.to_owned(),
        uid: user.uid.as_raw(),
        gid: user.gid.as_raw(),
        groups,
    }
}

/// A copy of this test binary that any user can execute: the build tree
/// (the repository, at an unknown path) may be unreadable to them.
fn exe_copy() -> &'static Path {
    static COPY: OnceLock<PathBuf> = OnceLock::new();
    COPY.get_or_init(|| {
        sweep_stale_copies();
        // The pid in the name lets a later run remove a copy this process
        // could not (a test binary killed before its exit handlers ran).
        let dir = tempfile::Builder::new()
            .prefix(&format!("{COPY_PREFIX}{}-", std::process::id()))
            .tempdir()
            .expect("a directory for the attacker binary")
            .keep();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))
            .expect("chmod the attacker directory");
        let exe = std::env::current_exe().expect("this test binary");
        let copy = dir.join("attacker");
        std::fs::copy(&exe, &copy).expect("copy the test binary");
        std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755))
            .expect("chmod the attacker binary");
        // A static is never dropped, so a TempDir held in one would leave a
        // copy of the test binary (tens of MiB) in /tmp on every run: remove
        // it when the test binary exits.
        extern "C" fn remove_copy() {
            if let Some(copy) = COPY.get()
                && let Some(dir) = copy.parent()
            {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
        // SAFETY: registers a plain `extern "C" fn()` with the C library; it
        // runs once at exit and touches only the filesystem.
        unsafe { libc::atexit(remove_copy) };
        copy
    })
}

/// Where the attacker copies live: `<tmp>/warden-attacker-<pid>-<random>`.
const COPY_PREFIX: &str = "warden-attacker-";

/// Removes the copies of test binaries whose process is gone.
fn sweep_stale_copies() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(COPY_PREFIX))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// What an attack process left.
#[derive(Debug)]
pub struct Outcome {
    /// The JSON the attack printed.
    pub result: serde_json::Value,
    /// Everything it printed, for assertion messages.
    pub stdout: String,
    /// Its stderr.
    pub stderr: String,
}

impl Outcome {
    /// `result[key]` as a string ("" when absent or not a string).
    pub fn str(&self, key: &str) -> &str {
        self.result[key].as_str().unwrap_or_default()
    }
}

/// Runs `attack` as `who` (its uid, primary gid and supplementary groups,
/// nothing of root's) in a copy of this test binary, with `args` for it;
/// returns the JSON line it printed. Fails the test, with what the process
/// printed, when it printed none (it panicked, or the attack is unknown).
pub fn run_as(who: &Ident, attack: &str, args: &serde_json::Value) -> Outcome {
    use std::os::unix::process::CommandExt;
    let exe = exe_copy();
    let mut cmd = Command::new(exe);
    cmd.args(["--exact", "attacker", "--nocapture", "--test-threads=1"])
        .current_dir(exe.parent().expect("the copy's directory"))
        .env(ATTACK_VAR, attack)
        .env(ARGS_VAR, args.to_string())
        .env("HOME", "/nonexistent")
        .env("USER", &who.name);
    let (uid, gid) = (Uid::from_raw(who.uid), Gid::from_raw(who.gid));
    let groups: Vec<Gid> = who.groups.iter().copied().map(Gid::from_raw).collect();
    // SAFETY: runs in the forked child before exec. It only makes the three
    // system calls (no allocation: `groups` was built before the fork, and
    // nix passes the slice straight to the kernel), each async-signal-safe;
    // the order (groups and gid while still root, uid last) is the only one
    // that drops every privilege.
    unsafe {
        cmd.pre_exec(move || {
            nix::unistd::setgroups(&groups)?;
            nix::unistd::setgid(gid)?;
            nix::unistd::setuid(uid)?;
            Ok(())
        });
    }
    // A bound, not a pace: the 16 MiB flight dumps of state_files took
    // over 60 s at CI's load 25; each caller's own `within` is tighter
    // where it needs to be.
    let done = super::run(&mut cmd, Duration::from_secs(240));
    let line = done
        .stdout
        .lines()
        .find_map(|l| l.split_once(RESULT_PREFIX).map(|(_, r)| r))
        .map(str::to_owned);
    let Some(line) = line else {
        panic!(
            "attack {attack} as {} printed no result ({})\n--- stdout ---\n{}\n--- stderr ---\n{}",
            who.name, done.status, done.stdout, done.stderr
        );
    };
    let result = serde_json::from_str(&line)
        .unwrap_or_else(|e| panic!("attack {attack}: result {line:?} is not JSON: {e}"));
    Outcome {
        result,
        stdout: done.stdout,
        stderr: done.stderr,
    }
}

/// An attack: its arguments in, its result out (one JSON value).
pub type Attack = fn(&serde_json::Value) -> serde_json::Value;

/// The body of the test crate's `#[test] fn attacker()`: nothing unless
/// [`ATTACK_VAR`] is set (an ordinary test run); else runs the attack it
/// names from `table` and prints its result on one line.
pub fn dispatch(table: &[(&str, Attack)]) {
    let Ok(name) = std::env::var(ATTACK_VAR) else {
        return;
    };
    let args: serde_json::Value = std::env::var(ARGS_VAR)
        .ok()
        .map(|a| serde_json::from_str(&a).expect("attack arguments as JSON"))
        .unwrap_or_default();
    let Some((_, attack)) = table.iter().find(|(n, _)| *n == name) else {
        let known: Vec<&str> = table.iter().map(|(n, _)| *n).collect();
        panic!("no attack named {name:?}; known: {known:?}");
    };
    let result = attack(&args);
    // On a line of its own: libtest prints "test attacker ... " before.
    println!("\n{RESULT_PREFIX}{result}");
}

/// Runs an async attack body on a fresh runtime (attacks are plain fns).
pub fn block_on<F: std::future::Future>(fut: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime for the attack")
        .block_on(fut)
}

/// A gRPC call's outcome as JSON: `{"ok": true}` plus `value`'s fields, or
/// `{"ok": false, "code": "PermissionDenied", "message": "..."}`.
pub fn call_result<T>(
    r: Result<T, tonic::Status>,
    value: impl FnOnce(T) -> serde_json::Value,
) -> serde_json::Value {
    match r {
        Ok(v) => {
            let mut out = serde_json::json!({"ok": true});
            if let (Some(o), serde_json::Value::Object(fields)) = (out.as_object_mut(), value(v)) {
                o.extend(fields);
            }
            out
        }
        Err(s) => serde_json::json!({
            "ok": false,
            "code": format!("{:?}", s.code()),
            "message": s.message(),
        }),
    }
}

/// The address of the agent socket in an attack's arguments (`"socket"`).
pub fn socket_arg(args: &serde_json::Value) -> PathBuf {
    PathBuf::from(
        args["socket"]
            .as_str()
            .expect("the attack's arguments name the agent's \"socket\""),
    )
}
