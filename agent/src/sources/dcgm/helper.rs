//! The DCGM helper process (`wardend --dcgm-helper`): the only place the
//! DCGM library is loaded. The agent's DCGM source talks to it over its
//! stdin/stdout, one JSON document a line, and gives each call a deadline:
//! a call that hangs is answered by killing the helper, and a crash in the
//! library ends the helper, not the agent. Both are reported as the `dcgm`
//! component UNKNOWN with the reason, and the helper is started again.

use std::io::{BufRead, Write};

use serde::{Deserialize, Serialize};

use super::ffi::{Dcgm, DcgmIncident, NO_LIBRARY, OpenParams};

/// What the agent asks.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum HelperRequest {
    /// Load, initialise, connect (or start embedded), set the watches.
    Open(OpenParams),
    /// One `dcgmHealthCheck`.
    Check,
}

/// What the helper answers.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "answer", rename_all = "snake_case")]
pub enum Response {
    /// DCGM is open.
    Opened {
        /// The library loaded.
        library: String,
        /// GPU ids DCGM supports.
        gpus: Vec<u32>,
        /// Health response version in use.
        response_version: u32,
    },
    /// One health check.
    Checked {
        /// Overall result (PASS 0, WARN 10, FAIL 20).
        overall: u32,
        /// Its incidents.
        incidents: Vec<DcgmIncident>,
        /// Health response version that worked.
        response_version: u32,
    },
    /// DCGM is not installed and the config does not name a library:
    /// absent by design.
    Absent {
        /// The loader's words.
        message: String,
    },
    /// A call failed; DCGM's words.
    Error {
        /// What failed.
        message: String,
    },
}

/// Runs the helper until stdin closes; returns the process exit code.
pub fn main() -> i32 {
    let stdin = std::io::stdin();
    let mut out = std::io::stdout().lock();
    let mut dcgm: Option<Dcgm> = None;
    for line in stdin.lock().lines() {
        let Ok(line) = line else {
            return 1;
        };
        let answer = match serde_json::from_str::<HelperRequest>(&line) {
            Err(e) => Response::Error {
                message: format!("bad request from the agent: {e}"),
            },
            Ok(HelperRequest::Open(p)) => {
                dcgm = None;
                match Dcgm::load(&p).and_then(|(lib, name)| {
                    let d = Dcgm::open_loaded(lib, name, &p)?;
                    let gpus = d.gpus()?;
                    Ok((d, gpus))
                }) {
                    Ok((d, gpus)) => {
                        let r = Response::Opened {
                            library: d.library.clone(),
                            gpus,
                            response_version: d.response_version(),
                        };
                        dcgm = Some(d);
                        r
                    }
                    // No library under the default names, and none named
                    // in the config: DCGM is not installed here.
                    Err(message) if p.library.is_empty() && message.starts_with(NO_LIBRARY) => {
                        Response::Absent { message }
                    }
                    Err(message) => Response::Error { message },
                }
            }
            Ok(HelperRequest::Check) => match dcgm.as_mut() {
                None => Response::Error {
                    message: "DCGM is not open".into(),
                },
                Some(d) => match d.check() {
                    Ok((overall, incidents)) => Response::Checked {
                        overall,
                        incidents,
                        response_version: d.response_version(),
                    },
                    Err(message) => Response::Error { message },
                },
            },
        };
        let Ok(text) = serde_json::to_string(&answer) else {
            return 1;
        };
        if writeln!(out, "{text}").and_then(|()| out.flush()).is_err() {
            return 0;
        }
    }
    0
}
