//! Issue 29 point 11: text a rank wrote reaches an operator's terminal.
//! A member of the socket group registers a rank whose host name and
//! exception carry terminal escapes (clear the screen, set the window's
//! title, a CSI in its C1 form, a bidi override) and a newline that would
//! forge a line of `warden events`; root then runs `warden events` and
//! `warden incidents`, and neither prints a control character but newline
//! and tab: each is shown written out (`\u{1b}`), nothing of the text lost.

use serde_json::{Value, json};
use warden_proto::v1 as pb;
use warden_proto::v1::agent_client::AgentClient;

use crate::common::users::{self, block_on, call_result, socket_arg};
use crate::common::{TestAgent, WAIT, WARDEN, within};

/// Clears the screen, sets the title, a C1 CSI, a bidi override, and a
/// newline followed by what looks like an event line.
const HOSTILE: &str = "boom\u{1b}[2J\u{1b}]0;owned\u{7}\u{9b}31m\u{202e}txt.exe\r\nFORGED 1970-01-01T00:00:00Z info node.healthy";

/// As the member: register this process as a rank of `args.job` with a
/// hostile host name, then report a hostile exception for it.
pub fn attack_escapes(args: &Value) -> Value {
    block_on(async {
        let ch = warden_cli::Target::Unix(socket_arg(args))
            .channel()
            .await
            .expect("the member connects");
        let mut c = AgentClient::new(ch);
        let job = args["job"].as_str().expect("a job").to_owned();
        let registered = c
            .register_rank(pb::RegisterRankRequest {
                job_id: job.clone(),
                global_rank: 0,
                local_rank: 0,
                world_size: 1,
                pid: std::process::id(),
                host: format!("host{HOSTILE}"),
                slot_layout_version: warden_client::slot::LAYOUT_VERSION,
                previous_slot: None,
                stack_dump_signal: 0,
                devices: Vec::new(),
            })
            .await;
        let generation = match &registered {
            Ok(r) => r.get_ref().generation,
            Err(_) => 0,
        };
        let reported = c
            .report_exception(pb::ReportExceptionRequest {
                job_id: job,
                global_rank: 0,
                generation,
                pid: std::process::id(),
                exception_type: "RuntimeError".into(),
                message: HOSTILE.into(),
                traceback: format!("Traceback (most recent call last):\n{HOSTILE}"),
                step: 7,
                uncaught: false,
                awaits_decision: false,
            })
            .await;
        json!({
            "registered": call_result(registered, |_| json!({})),
            "reported": call_result(reported, |_| json!({})),
        })
    })
}

/// The control characters in `s` but newline and tab.
fn controls(s: &str) -> Vec<char> {
    s.chars()
        .filter(|c| c.is_control() && *c != '\n' && *c != '\t')
        .chain(s.chars().filter(|c| ('\u{202a}'..='\u{202e}').contains(c)))
        .collect()
}

fn cli(agent: &TestAgent, args: &[&str]) -> String {
    let out = std::process::Command::new(WARDEN)
        .arg("--socket")
        .arg(agent.socket())
        .args(args)
        .output()
        .expect("run warden");
    assert!(out.status.success(), "{args:?}: {out:?}");
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

#[tokio::test(flavor = "multi_thread")]
async fn terminal_escapes_from_a_rank_never_reach_the_operators_terminal() {
    let agent = TestAgent::start_shared("");
    let u = users::users();
    let args = json!({"socket": agent.socket(), "job": "esc-job"});
    let attack = within(WAIT * 6, "the member's reports", async {
        tokio::task::spawn_blocking(move || users::run_as(&u.member, "output.escapes", &args))
            .await
            .expect("run the attack")
    })
    .await;
    assert_eq!(attack.result["registered"]["ok"], json!(true), "{attack:?}");
    assert_eq!(attack.result["reported"]["ok"], json!(true), "{attack:?}");

    // The exception's event is there (the agent took the text as it came).
    let events = within(WAIT * 2, "the exception's event", async {
        loop {
            let text = tokio::task::block_in_place(|| cli(&agent, &["events"]));
            if text.contains("rank.exception") {
                return text;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(
        controls(&events).is_empty(),
        "raw control characters: {events:?}"
    );
    // Written out, not dropped.
    assert!(events.contains("\\u{1b}[2J"), "{events}");
    assert!(events.contains("\\u{202e}"), "{events}");
    // The forged line did not start a line of its own.
    assert!(
        !events.lines().any(|l| l.starts_with("FORGED")),
        "a rank's newline started a line: {events}"
    );

    let incidents = tokio::task::block_in_place(|| cli(&agent, &["incidents", "-v"]));
    assert!(
        controls(&incidents).is_empty(),
        "raw control characters: {incidents:?}"
    );
    let ranks = tokio::task::block_in_place(|| cli(&agent, &["ranks"]));
    assert!(
        controls(&ranks).is_empty(),
        "raw control characters: {ranks:?}"
    );
}
