//! `warden health --plugin`: the node's health for node-problem-detector.
//!
//! NPD's custom-plugin contract: the command exits 0 (healthy), 1 (a
//! problem) or 2 (unknown), and NPD keeps the first `max_output_length`
//! bytes of stdout (80 by default) as the condition's message. So this mode
//! prints exactly one line of at most [`MAX_MESSAGE`] bytes on stdout,
//! nothing on stderr, and gives up after [`DEADLINE`] (NPD kills a plugin at
//! its `timeout`, 5 s by default, and would then report nothing useful).
//!
//! | exit | when | message |
//! |---|---|---|
//! | 1 | the node is cordoned (component `node/cordon` FAILED) | `CORDONED, FAILED gpu3: <reason>`, or `CORDONED: <why>` when nothing else failed |
//! | 1 | the node's status is FAILED | `FAILED gpu3: <reason> (+2 more)` |
//! | 0 | DEGRADED: a warning, not a problem NPD should act on | `DEGRADED host/memory: <reason>` |
//! | 0 | OK, or UNKNOWN (a source that cannot read, e.g. no NVML) | `OK: 12 components healthy (2 unknown)` |
//! | 2 | the agent cannot be reached, answers an error, or too late | `UNKNOWN: cannot reach wardend at <socket>` |
//!
//! [`judge`] is the pure part (NodeHealth in, verdict out) and is tested
//! with a table of cases; [`check`] adds the call with its deadline.

use std::io::Write as _;
use std::time::Duration;

use warden_proto::v1 as pb;

use super::connect::Target;

/// How long connecting and asking may take, together: under NPD's default
/// 5 s plugin timeout, with room to start the process and print.
pub const DEADLINE: Duration = Duration::from_secs(4);

/// NPD's default `max_output_length`: longer messages are cut there.
pub const MAX_MESSAGE: usize = 80;

/// The component through which the agent reports that a decision cordoned
/// the node (FAILED while cordoned).
pub const CORDON_COMPONENT: &str = "node/cordon";

/// NPD's reading of a plugin's exit status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Exit 0: the condition is false (no problem).
    Healthy,
    /// Exit 1: the condition is true (a problem).
    Problem,
    /// Exit 2: the plugin could not tell.
    Unknown,
}

impl Verdict {
    /// The exit status NPD expects for this verdict.
    pub fn exit_code(self) -> u8 {
        match self {
            Verdict::Healthy => 0,
            Verdict::Problem => 1,
            Verdict::Unknown => 2,
        }
    }
}

/// What the plugin reports: a verdict and its one-line message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginReport {
    /// The exit status to return.
    pub verdict: Verdict,
    /// One line, at most [`MAX_MESSAGE`] bytes, no newline.
    pub message: String,
}

impl PluginReport {
    fn new(verdict: Verdict, head: &str, body: &str, tail: &str) -> Self {
        Self {
            verdict,
            message: fit(head, body, tail),
        }
    }
}

/// `head + body + tail` on one line within [`MAX_MESSAGE`] bytes: control
/// characters become spaces and, when too long, the body is cut (at a
/// character boundary, marked "...") so the head and tail survive.
pub fn fit(head: &str, body: &str, tail: &str) -> String {
    let one_line = |s: &str| -> String {
        s.chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .collect()
    };
    let (head, body, tail) = (one_line(head), one_line(body.trim()), one_line(tail));
    if head.len() + body.len() + tail.len() <= MAX_MESSAGE {
        return format!("{head}{body}{tail}");
    }
    const MORE: &str = "...";
    let room = MAX_MESSAGE.saturating_sub(head.len() + tail.len() + MORE.len());
    let mut cut = room.min(body.len());
    while !body.is_char_boundary(cut) {
        cut -= 1;
    }
    let out = format!("{head}{}{MORE}{tail}", body[..cut].trim_end());
    if out.len() <= MAX_MESSAGE {
        return out;
    }
    // Head and tail alone are too long (a very long socket path): cut the whole.
    let mut cut = MAX_MESSAGE - MORE.len();
    while !out.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}{MORE}", &out[..cut])
}

fn status(v: i32) -> pb::Status {
    pb::Status::try_from(v).unwrap_or(pb::Status::Unspecified)
}

/// A component's first reason, for a person ("XID 79 GPU fell off the bus").
fn reason_text(c: &pb::Component) -> String {
    let Some(r) = c.reasons.first() else {
        return String::new();
    };
    if !r.message.is_empty() {
        r.message.clone()
    } else if !r.value.is_empty() {
        format!("{}={}", r.signal, r.value)
    } else {
        r.signal.clone()
    }
}

/// "FAILED gpu3: reason (+2 more)" for the first component with `wanted`;
/// `None` when none has it.
fn worst(
    h: &pb::NodeHealth,
    wanted: pb::Status,
    name: &str,
    verdict: Verdict,
) -> Option<PluginReport> {
    let mut matching = h
        .components
        .iter()
        .filter(|c| c.id != CORDON_COMPONENT && status(c.status) == wanted);
    let first = matching.next()?;
    let more = matching.count();
    let tail = if more > 0 {
        format!(" (+{more} more)")
    } else {
        String::new()
    };
    let reason = reason_text(first);
    let head = if reason.is_empty() {
        format!("{name} {}", first.id)
    } else {
        format!("{name} {}: ", first.id)
    };
    Some(PluginReport::new(verdict, &head, &reason, &tail))
}

/// The verdict on a NodeHealth (see the module's table).
pub fn judge(h: &pb::NodeHealth) -> PluginReport {
    let cordon = h
        .components
        .iter()
        .find(|c| c.id == CORDON_COMPONENT && status(c.status) == pb::Status::Failed);
    if let Some(cordon) = cordon {
        // The failed device says more in 80 bytes than the cordon's own
        // reason (which starts with a long incident id); without one, the
        // cordon's reason is all there is.
        if let Some(failed) = worst(h, pb::Status::Failed, "CORDONED, FAILED", Verdict::Problem) {
            return failed;
        }
        let why = reason_text(cordon);
        let why = if why.is_empty() {
            "a remediation decision took the node out".to_owned()
        } else {
            why
        };
        return PluginReport::new(Verdict::Problem, "CORDONED: ", &why, "");
    }
    match status(h.status) {
        // A worst status no component has: the agent's own inconsistency,
        // reported as it stands.
        pb::Status::Failed => worst(h, pb::Status::Failed, "FAILED", Verdict::Problem)
            .unwrap_or_else(|| PluginReport::new(Verdict::Problem, "FAILED", "", "")),
        pb::Status::Degraded => worst(h, pb::Status::Degraded, "DEGRADED", Verdict::Healthy)
            .unwrap_or_else(|| PluginReport::new(Verdict::Healthy, "DEGRADED", "", "")),
        pb::Status::Ok | pb::Status::Unknown | pb::Status::Absent => {
            let count = |s: pb::Status| {
                h.components
                    .iter()
                    .filter(|c| status(c.status) == s)
                    .count()
            };
            let (ok, unknown) = (count(pb::Status::Ok), count(pb::Status::Unknown));
            let noun = if ok == 1 { "component" } else { "components" };
            let tail = if unknown > 0 {
                format!(" ({unknown} unknown)")
            } else {
                String::new()
            };
            PluginReport::new(
                Verdict::Healthy,
                &format!("OK: {ok} {noun} healthy"),
                "",
                &tail,
            )
        }
        pb::Status::Unspecified => PluginReport::new(
            Verdict::Unknown,
            "UNKNOWN: ",
            "wardend reported no node status",
            "",
        ),
    }
}

/// Where the agent is, as short as it can be said (no "unix:" prefix).
fn place(target: &Target) -> String {
    match target {
        Target::Unix(p) => p.display().to_string(),
        Target::Tcp(a) => a.clone(),
    }
}

/// Asks the agent for the node's health within [`DEADLINE`] and judges it;
/// an agent that cannot be reached, errs or is too slow is [`Verdict::Unknown`].
pub async fn check(target: &Target) -> PluginReport {
    let at = place(target);
    let ask = async {
        let mut client = target.connect().await.map_err(|_| None)?;
        client
            .get_node_health(pb::GetNodeHealthRequest {})
            .await
            .map(tonic::Response::into_inner)
            .map_err(Some)
    };
    match tokio::time::timeout(DEADLINE, ask).await {
        Ok(Ok(health)) => judge(&health),
        Ok(Err(None)) => PluginReport::new(
            Verdict::Unknown,
            "UNKNOWN: ",
            &format!("cannot reach wardend at {at}"),
            "",
        ),
        Ok(Err(Some(status))) => PluginReport::new(
            Verdict::Unknown,
            "UNKNOWN: ",
            &format!(
                "wardend at {at} answered {:?}: {}",
                status.code(),
                status.message()
            ),
            "",
        ),
        Err(_) => PluginReport::new(
            Verdict::Unknown,
            "UNKNOWN: ",
            &format!(
                "wardend at {at} did not answer within {}s",
                DEADLINE.as_secs()
            ),
            "",
        ),
    }
}

/// Runs the plugin: prints the one line on stdout and returns the exit
/// status for NPD. Never writes to stderr.
pub async fn run(target: &Target) -> u8 {
    let report = check(target).await;
    let mut out = std::io::stdout().lock();
    // Nothing to do if NPD closed our stdout: the exit status still counts.
    let _ = writeln!(out, "{}", report.message);
    let _ = out.flush();
    report.verdict.exit_code()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn component(id: &str, s: pb::Status, message: &str) -> pb::Component {
        pb::Component {
            id: id.into(),
            status: s as i32,
            reasons: if message.is_empty() {
                vec![]
            } else {
                vec![pb::Reason {
                    status: s as i32,
                    message: message.into(),
                    ..Default::default()
                }]
            },
            ..Default::default()
        }
    }

    fn node(s: pb::Status, components: Vec<pb::Component>) -> pb::NodeHealth {
        pb::NodeHealth {
            host: "n1".into(),
            status: s as i32,
            components,
            observed_at: None,
        }
    }

    #[test]
    fn verdicts() {
        use pb::Status::{Degraded, Failed, Ok, Unknown, Unspecified};
        let long = "x".repeat(200);
        // 80 bytes: the head, 54 of the reason, "...", the tail.
        let cut = format!("FAILED gpu1: {}... (+1 more)", "x".repeat(54));
        let cases: Vec<(&str, pb::NodeHealth, Verdict, &str)> = vec![
            (
                "all ok",
                node(
                    Ok,
                    vec![component("agent", Ok, ""), component("host/memory", Ok, "")],
                ),
                Verdict::Healthy,
                "OK: 2 components healthy",
            ),
            (
                "one ok",
                node(Ok, vec![component("agent", Ok, "")]),
                Verdict::Healthy,
                "OK: 1 component healthy",
            ),
            (
                "unknown is not a problem",
                node(
                    Unknown,
                    vec![
                        component("agent", Ok, ""),
                        component("nvml", Unknown, "no NVML"),
                    ],
                ),
                Verdict::Healthy,
                "OK: 1 component healthy (1 unknown)",
            ),
            (
                "degraded warns, exit 0",
                node(
                    Degraded,
                    vec![
                        component("agent", Ok, ""),
                        component("host/memory", Degraded, "8% memory available"),
                    ],
                ),
                Verdict::Healthy,
                "DEGRADED host/memory: 8% memory available",
            ),
            (
                "failed, counting the others",
                node(
                    Failed,
                    vec![
                        component("gpu0", Degraded, "hot"),
                        component("gpu3", Failed, "XID 79 GPU fell off the bus"),
                        component("gpu4", Failed, "XID 79"),
                        component("gpu5", Failed, "XID 79"),
                    ],
                ),
                Verdict::Problem,
                "FAILED gpu3: XID 79 GPU fell off the bus (+2 more)",
            ),
            (
                "failed without a reason",
                node(Failed, vec![component("gpu3", Failed, "")]),
                Verdict::Problem,
                "FAILED gpu3",
            ),
            (
                "cordoned, naming the failed device",
                node(
                    Failed,
                    vec![
                        component("gpu3", Failed, "XID 79"),
                        component(
                            CORDON_COMPONENT,
                            Failed,
                            "inc-7: uncorrectable_hardware on gpu3",
                        ),
                    ],
                ),
                Verdict::Problem,
                "CORDONED, FAILED gpu3: XID 79",
            ),
            (
                "cordoned, the device since recovered",
                node(
                    Failed,
                    vec![
                        component("gpu3", Ok, ""),
                        component(
                            CORDON_COMPONENT,
                            Failed,
                            "inc-7: uncorrectable_hardware on gpu3",
                        ),
                    ],
                ),
                Verdict::Problem,
                "CORDONED: inc-7: uncorrectable_hardware on gpu3",
            ),
            (
                "a lifted cordon is no problem",
                node(Ok, vec![component(CORDON_COMPONENT, Ok, "")]),
                Verdict::Healthy,
                "OK: 1 component healthy",
            ),
            (
                "no status",
                node(Unspecified, vec![]),
                Verdict::Unknown,
                "UNKNOWN: wardend reported no node status",
            ),
            (
                "long reason cut, tail kept",
                node(
                    Failed,
                    vec![
                        component("gpu1", Failed, &long),
                        component("gpu2", Failed, "x"),
                    ],
                ),
                Verdict::Problem,
                &cut,
            ),
            (
                "newlines flattened",
                node(
                    Failed,
                    vec![component("gpu1", Failed, "line one\nline two")],
                ),
                Verdict::Problem,
                "FAILED gpu1: line one line two",
            ),
        ];
        for (name, health, verdict, message) in cases {
            let r = judge(&health);
            assert_eq!(
                (r.verdict, r.message.as_str()),
                (verdict, message),
                "{name}"
            );
            assert!(r.message.len() <= MAX_MESSAGE, "{name}: {}", r.message);
        }
    }

    #[test]
    fn exit_codes_are_npd_s() {
        assert_eq!(Verdict::Healthy.exit_code(), 0);
        assert_eq!(Verdict::Problem.exit_code(), 1);
        assert_eq!(Verdict::Unknown.exit_code(), 2);
    }

    #[test]
    fn fit_cuts_at_char_boundaries() {
        let body = "é".repeat(100);
        let s = fit("FAILED gpu1: ", &body, " (+1 more)");
        assert!(s.len() <= MAX_MESSAGE, "{s}");
        assert!(
            s.starts_with("FAILED gpu1: é") && s.ends_with("... (+1 more)"),
            "{s}"
        );
        let head = format!("UNKNOWN: cannot reach wardend at /{}", "d/".repeat(60));
        let s = fit(&head, "", "");
        assert_eq!(s.len(), MAX_MESSAGE, "{s}");
        assert!(s.ends_with("..."), "{s}");
    }

    #[tokio::test]
    async fn no_agent_is_unknown() {
        let dir = std::env::temp_dir().join("warden-plugin-test-no-such-dir");
        let r = check(&Target::Unix(dir.join("nobody.sock"))).await;
        assert_eq!(r.verdict, Verdict::Unknown);
        assert!(
            r.message.starts_with("UNKNOWN: cannot reach wardend at /"),
            "{}",
            r.message
        );
    }
}
