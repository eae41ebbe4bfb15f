//! The DCGM binding: `libdcgm.so.4` (or `.so.3`) opened at run time with
//! libloading, the few calls the health source makes, and the versioned
//! structs with DCGM's C layout (checked against dcgm_structs.h 4.x; see
//! ../shared/dcgm-facts.md). Runs only inside the helper process
//! (`wardend --dcgm-helper`), so a crash in the library ends the helper,
//! never the agent.

use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};

/// `dcgmHandle_t`, `dcgmGpuGrp_t`.
type Handle = usize;

/// `DCGM_GROUP_ALL_GPUS`: needs no creation.
const GROUP_ALL_GPUS: usize = 0x7fff_ffff;
/// `DCGM_GROUP_ALL_NVSWITCHES`: likewise.
const GROUP_ALL_NVSWITCHES: usize = 0x7fff_fffe;
/// `DCGM_ST_VER_MISMATCH`.
const ST_VER_MISMATCH: c_int = -12;
/// `DCGM_MAX_NUM_DEVICES`.
const MAX_DEVICES: usize = 32;
/// Bytes of one `dcgmIncidentInfo_t` (system, health, 1028-byte error
/// detail, entity pair).
const INCIDENT_BYTES: usize = 1044;
/// `dcgmHealthResponse_v5`: 12-byte header and 1024 incidents.
const V5_INCIDENTS: usize = 1024;
/// `dcgmHealthResponse_v4` (DCGM 3.x): 64 incidents.
const V4_INCIDENTS: usize = 64;

/// `dcgmConnectV2Params_v2`.
#[repr(C)]
struct ConnectV2Params {
    version: c_uint,
    persist_after_disconnect: c_uint,
    timeout_ms: c_uint,
    address_is_unix_socket: c_uint,
}

/// `MAKE_DCGM_VERSION`: the struct's size in the low 24 bits, the version
/// above.
const fn version(size: usize, v: u32) -> u32 {
    (size as u32) | (v << 24)
}

/// The health response's size for `incidents` entries.
const fn response_bytes(incidents: usize) -> usize {
    12 + incidents * INCIDENT_BYTES
}

type FnVoid = unsafe extern "C" fn() -> c_int;
type FnConnect = unsafe extern "C" fn(*const c_char, *mut ConnectV2Params, *mut Handle) -> c_int;
type FnStartEmbedded = unsafe extern "C" fn(c_uint, *mut Handle) -> c_int;
type FnHandle = unsafe extern "C" fn(Handle) -> c_int;
type FnDevices = unsafe extern "C" fn(Handle, *mut c_uint, *mut c_int) -> c_int;
type FnHealthSet = unsafe extern "C" fn(Handle, Handle, c_uint) -> c_int;
type FnHealthCheck = unsafe extern "C" fn(Handle, Handle, *mut c_void) -> c_int;
type FnErrorString = unsafe extern "C" fn(c_int) -> *const c_char;

/// One incident as DCGM reports it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DcgmIncident {
    /// The health system (bit), `u32::MAX` for ALL.
    pub system: u32,
    /// PASS 0, WARN 10, FAIL 20.
    pub health: u32,
    /// `dcgmError_t`.
    pub code: u32,
    /// DCGM's message.
    pub message: String,
    /// Entity group (GPU 1, SWITCH 3, LINK 6...).
    pub entity_group: u32,
    /// Entity id within the group.
    pub entity_id: u32,
}

/// An open DCGM session (connected or embedded).
pub struct Dcgm {
    lib: libloading::Library,
    handle: Handle,
    embedded: bool,
    /// The health response version that works: 5 (DCGM 4) or 4 (DCGM 3).
    response_version: u32,
    /// The library that was loaded.
    pub library: String,
    /// True when the NVSwitch group took the health watches (a node with
    /// NVSwitches); its incidents are checked too.
    pub nvswitches: bool,
}

impl std::fmt::Debug for Dcgm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dcgm")
            .field("library", &self.library)
            .field("embedded", &self.embedded)
            .field("response_version", &self.response_version)
            .finish_non_exhaustive()
    }
}

/// How [`Dcgm::load`]'s error begins when no candidate library loads.
pub const NO_LIBRARY: &str = "no DCGM library";

/// How to reach DCGM.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct OpenParams {
    /// A path or file name; empty: libdcgm.so.4, then libdcgm.so.3.
    pub library: String,
    /// Start DCGM inside this process (AUTO mode) instead of connecting.
    pub embedded: bool,
    /// "host:port" or "unix:/path" of nv-hostengine.
    pub address: String,
    /// Health systems to watch (bitmask).
    pub systems: u32,
    /// Connection timeout.
    pub timeout_ms: u32,
}

fn sym<T: Copy>(lib: &libloading::Library, name: &[u8]) -> Result<T, String> {
    // SAFETY: the symbol's type is the one DCGM's header declares for it
    // (see the aliases above); it is copied out while `lib` stays loaded.
    unsafe { lib.get::<T>(name) }.map(|s| *s).map_err(|e| {
        format!(
            "{} not found in the DCGM library: {e}",
            String::from_utf8_lossy(name).trim_end_matches('\0')
        )
    })
}

impl Dcgm {
    /// Loads the library, initialises it and connects (or starts embedded),
    /// then sets the health watches.
    pub fn open(p: &OpenParams) -> Result<Self, String> {
        let (lib, library) = Self::load(p)?;
        Self::open_loaded(lib, library, p)
    }

    /// Loads the library only: its error, where `p.library` is empty, means
    /// DCGM is not installed (absent by design, not a failure).
    pub fn load(p: &OpenParams) -> Result<(libloading::Library, String), String> {
        let candidates: Vec<String> = if p.library.is_empty() {
            vec!["libdcgm.so.4".into(), "libdcgm.so.3".into()]
        } else {
            vec![p.library.clone()]
        };
        let mut errors = Vec::new();
        let mut loaded = None;
        for c in &candidates {
            // SAFETY: loading a shared library runs its initialisers; DCGM's
            // are the vendor's, and this runs in the helper process only.
            match unsafe { libloading::Library::new(c) } {
                Ok(lib) => {
                    loaded = Some((lib, c.clone()));
                    break;
                }
                Err(e) => errors.push(format!("{c}: {e}")),
            }
        }
        loaded.ok_or_else(|| format!("{NO_LIBRARY}: {}", errors.join("; ")))
    }

    /// Initialises a loaded library, connects (or starts embedded) and sets
    /// the health watches.
    pub fn open_loaded(
        lib: libloading::Library,
        library: String,
        p: &OpenParams,
    ) -> Result<Self, String> {
        let init: FnVoid = sym(&lib, b"dcgmInit\0")?;
        // SAFETY: dcgmInit takes no arguments.
        let rc = unsafe { init() };
        let mut me = Self {
            lib,
            handle: 0,
            embedded: p.embedded,
            response_version: 5,
            library,
            nvswitches: false,
        };
        if rc != 0 {
            return Err(format!("dcgmInit: {}", me.error_string(rc)));
        }
        let mut handle: Handle = 0;
        if p.embedded {
            let start: FnStartEmbedded = sym(&me.lib, b"dcgmStartEmbedded\0")?;
            // SAFETY: AUTO mode (1) and a valid out pointer.
            let rc = unsafe { start(1, &raw mut handle) };
            if rc != 0 {
                return Err(format!("dcgmStartEmbedded: {}", me.error_string(rc)));
            }
        } else {
            let connect: FnConnect = sym(&me.lib, b"dcgmConnect_v2\0")?;
            let (addr, unix) = match p.address.strip_prefix("unix:") {
                Some(path) => (path.to_owned(), 1),
                None => (p.address.clone(), 0),
            };
            let c_addr =
                CString::new(addr.clone()).map_err(|_| format!("address {addr:?} holds a NUL"))?;
            let mut params = ConnectV2Params {
                version: version(std::mem::size_of::<ConnectV2Params>(), 2),
                persist_after_disconnect: 0,
                timeout_ms: p.timeout_ms,
                address_is_unix_socket: unix,
            };
            // SAFETY: a NUL-terminated address, a params struct of the
            // declared layout and version, and a valid out pointer.
            let rc = unsafe { connect(c_addr.as_ptr(), &raw mut params, &raw mut handle) };
            if rc != 0 {
                return Err(format!(
                    "cannot connect to nv-hostengine at {}: {}",
                    p.address,
                    me.error_string(rc)
                ));
            }
        }
        me.handle = handle;
        let set: FnHealthSet = sym(&me.lib, b"dcgmHealthSet\0")?;
        // SAFETY: plain integers.
        let rc = unsafe { set(me.handle, GROUP_ALL_GPUS, p.systems) };
        if rc != 0 {
            return Err(format!("dcgmHealthSet: {}", me.error_string(rc)));
        }
        // NVSwitches, where there are any: a node without them refuses the
        // group, which is no error.
        // SAFETY: plain integers.
        me.nvswitches = unsafe { set(me.handle, GROUP_ALL_NVSWITCHES, p.systems) } == 0;
        Ok(me)
    }

    /// DCGM's words for a return code.
    pub fn error_string(&self, rc: c_int) -> String {
        let Ok(f) = sym::<FnErrorString>(&self.lib, b"errorString\0") else {
            return format!("DCGM error {rc}");
        };
        // SAFETY: errorString returns a static string or NULL.
        let p = unsafe { f(rc) };
        if p.is_null() {
            return format!("DCGM error {rc}");
        }
        // SAFETY: non-null, NUL-terminated, static in the library.
        let s = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
        format!("{s} ({rc})")
    }

    /// The GPUs DCGM supports.
    pub fn gpus(&self) -> Result<Vec<u32>, String> {
        let f: FnDevices = sym(&self.lib, b"dcgmGetAllSupportedDevices\0")?;
        let mut ids = [0 as c_uint; MAX_DEVICES];
        let mut count: c_int = 0;
        // SAFETY: a buffer of DCGM_MAX_NUM_DEVICES ids and a count.
        let rc = unsafe { f(self.handle, ids.as_mut_ptr(), &raw mut count) };
        if rc != 0 {
            return Err(format!(
                "dcgmGetAllSupportedDevices: {}",
                self.error_string(rc)
            ));
        }
        let n = usize::try_from(count).unwrap_or(0).min(MAX_DEVICES);
        Ok(ids[..n].to_vec())
    }

    /// The health response version in use (5 or 4).
    pub fn response_version(&self) -> u32 {
        self.response_version
    }

    /// One `dcgmHealthCheck` of all GPUs: the overall result and the
    /// incidents. Falls back from the v5 response (DCGM 4) to v4 (DCGM 3)
    /// on a version mismatch; neither: an error naming both.
    pub fn check(&mut self) -> Result<(u32, Vec<DcgmIncident>), String> {
        let (mut overall, mut incidents) = self.check_group(GROUP_ALL_GPUS)?;
        if self.nvswitches {
            let (o, more) = self.check_group(GROUP_ALL_NVSWITCHES)?;
            overall = overall.max(o);
            incidents.extend(more);
        }
        Ok((overall, incidents))
    }

    fn check_group(&mut self, group: usize) -> Result<(u32, Vec<DcgmIncident>), String> {
        let f: FnHealthCheck = sym(&self.lib, b"dcgmHealthCheck\0")?;
        let mut tried = Vec::new();
        for v in [
            self.response_version,
            if self.response_version == 5 { 4 } else { 5 },
        ] {
            let incidents = if v == 5 { V5_INCIDENTS } else { V4_INCIDENTS };
            let bytes = response_bytes(incidents);
            // u32 words: the struct's alignment is 4 (1 MiB for v5, so on
            // the heap).
            let mut buf = vec![0u32; bytes / 4];
            buf[0] = version(bytes, v);
            // SAFETY: a zeroed buffer of exactly the versioned struct's size,
            // 4-byte aligned, with its version word set.
            let rc = unsafe { f(self.handle, group, buf.as_mut_ptr().cast()) };
            if rc == ST_VER_MISMATCH {
                tried.push(format!("v{v} ({:#x})", version(bytes, v)));
                continue;
            }
            if rc != 0 {
                return Err(format!("dcgmHealthCheck: {}", self.error_string(rc)));
            }
            self.response_version = v;
            return Ok(parse_response(&buf, incidents));
        }
        Err(format!(
            "dcgmHealthCheck refuses every health response version warden knows ({}): unsupported DCGM version",
            tried.join(", ")
        ))
    }
}

/// Reads a health response out of its words.
fn parse_response(w: &[u32], capacity: usize) -> (u32, Vec<DcgmIncident>) {
    let overall = w.get(1).copied().unwrap_or(0);
    let count = (w.get(2).copied().unwrap_or(0) as usize).min(capacity);
    let mut out = Vec::with_capacity(count);
    for i in 0..count {
        let o = 3 + i * (INCIDENT_BYTES / 4);
        let Some(words) = w.get(o..o + INCIDENT_BYTES / 4) else {
            break;
        };
        let msg_bytes: Vec<u8> = words[2..2 + 256]
            .iter()
            .flat_map(|x| x.to_ne_bytes())
            .collect();
        let end = msg_bytes
            .iter()
            .position(|b| *b == 0)
            .unwrap_or(msg_bytes.len());
        out.push(DcgmIncident {
            system: words[0],
            health: words[1],
            code: words[258],
            message: String::from_utf8_lossy(&msg_bytes[..end]).into_owned(),
            entity_group: words[259],
            entity_id: words[260],
        });
    }
    (overall, out)
}

impl Drop for Dcgm {
    fn drop(&mut self) {
        let name: &[u8] = if self.embedded {
            b"dcgmStopEmbedded\0"
        } else {
            b"dcgmDisconnect\0"
        };
        if let Ok(f) = sym::<FnHandle>(&self.lib, name) {
            // SAFETY: the handle this session opened.
            unsafe { f(self.handle) };
        }
        if let Ok(f) = sym::<FnVoid>(&self.lib, b"dcgmShutdown\0") {
            // SAFETY: no arguments; after the handle is closed.
            unsafe { f() };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_match_dcgm_4() {
        assert_eq!(std::mem::size_of::<ConnectV2Params>(), 16);
        assert_eq!(version(16, 2), 0x0200_0010);
        assert_eq!(response_bytes(V5_INCIDENTS), 1_069_068);
        assert_eq!(version(response_bytes(V5_INCIDENTS), 5), 0x0510_500C);
        assert_eq!(version(response_bytes(V4_INCIDENTS), 4), 0x0401_050C);
    }

    #[test]
    fn parses_incidents_from_words() {
        let mut w = vec![0u32; response_bytes(4) / 4];
        w[1] = 20;
        w[2] = 1;
        let o = 3;
        w[o] = 0x10;
        w[o + 1] = 20;
        let msg = b"DBE on GPU 1\0";
        let mut bytes = [0u8; 1024];
        bytes[..msg.len()].copy_from_slice(msg);
        for (i, c) in bytes.chunks(4).enumerate() {
            w[o + 2 + i] = u32::from_ne_bytes([c[0], c[1], c[2], c[3]]);
        }
        w[o + 258] = 4;
        w[o + 259] = 1;
        w[o + 260] = 1;
        let (overall, inc) = parse_response(&w, 4);
        assert_eq!(overall, 20);
        assert_eq!(
            inc,
            vec![DcgmIncident {
                system: 0x10,
                health: 20,
                code: 4,
                message: "DBE on GPU 1".into(),
                entity_group: 1,
                entity_id: 1
            }]
        );
    }
}
