//! Issue 22, the slot file: nobody but the agent can truncate or replace a
//! rank's slot memory, and nobody but the rank can obtain it.
//!
//! The victim is this (root) process, registered as a rank. The attackers
//! are a member of the socket group (who may register ranks of its own)
//! and a stranger outside it. Every attack runs as that user, in a copy of
//! the test binary (see [`crate::common::users`]).

use std::os::fd::AsFd;
use std::time::Duration;

use serde_json::{Value, json};
use warden_client::slot::SlotMemory;
use warden_client::slot_socket::{SlotSocketError, fetch, socket_path};
use warden_proto::v1 as pb;

use crate::common::users::{self, block_on, socket_arg};
use crate::common::{TestAgent, WAIT, within};

const FETCH_WAIT: Duration = Duration::from_secs(10);

fn outcome(r: Result<std::os::fd::OwnedFd, SlotSocketError>) -> Value {
    match r {
        Ok(_) => json!({"got_fd": true}),
        Err(SlotSocketError::Refused { why, .. }) => json!({"got_fd": false, "refused": why}),
        Err(SlotSocketError::Io { op, source, .. }) => {
            json!({"got_fd": false, "io": op, "errno": source.raw_os_error()})
        }
    }
}

fn register(job: &str, pid: u32) -> pb::RegisterRankRequest {
    pb::RegisterRankRequest {
        job_id: job.to_owned(),
        global_rank: 0,
        local_rank: 0,
        world_size: 1,
        pid,
        host: "slots".to_owned(),
        slot_layout_version: warden_client::slot::LAYOUT_VERSION,
        previous_slot: None,
        stack_dump_signal: 0,
        devices: Vec::new(),
    }
}

/// As another user: ask the slot socket for the victim's memory (its
/// generation `args.generation`, and the ones around it), look for any
/// slot file beside the socket, and (a member only) register a rank of its
/// own, receive that memory and try to resize it.
pub fn attack_slots(args: &Value) -> Value {
    let socket = socket_arg(args);
    let slot_socket = socket_path(&socket);
    let victim = args["generation"]
        .as_u64()
        .expect("the victim's generation");
    let theft = outcome(fetch(&slot_socket, victim, FETCH_WAIT));
    let neighbours: Vec<Value> = (victim.saturating_sub(3)..=victim + 3)
        .filter(|g| *g != victim)
        .map(|g| outcome(fetch(&slot_socket, g, FETCH_WAIT)))
        .collect();
    let slot_files: Vec<String> = std::fs::read_dir(socket.parent().expect("a directory"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("slots"))
                .collect()
        })
        .unwrap_or_default();
    let own = if args["register"].as_bool() == Some(true) {
        block_on(async {
            let mut c = warden_proto::v1::agent_client::AgentClient::new(
                warden_cli::Target::Unix(socket.clone())
                    .channel()
                    .await
                    .expect("the member connects"),
            );
            let r = c
                .register_rank(register("member-own", std::process::id()))
                .await
                .expect("the member registers its own rank")
                .into_inner();
            let fd = fetch(&slot_socket, r.generation, FETCH_WAIT).expect("its own memory");
            let file = std::fs::File::from(fd.as_fd().try_clone_to_owned().expect("dup"));
            let shrink = file.set_len(0).err().and_then(|e| e.raw_os_error());
            let grow = file.set_len(1 << 20).err().and_then(|e| e.raw_os_error());
            let generation = SlotMemory::open(fd)
                .map(|m| m.slot().generation())
                .unwrap_or_default();
            json!({"generation": generation, "expected": r.generation,
                   "shrink_errno": shrink, "grow_errno": grow})
        })
    } else {
        Value::Null
    };
    json!({"theft": theft, "neighbours": neighbours, "slot_files": slot_files, "own": own})
}

#[tokio::test(flavor = "multi_thread")]
async fn nobody_else_obtains_or_resizes_a_ranks_slot_memory() {
    let agent = TestAgent::start_shared("");
    let mut c = agent.client().await;
    let me = c
        .register_rank(register("victim-slots", std::process::id()))
        .await
        .expect("the victim registers")
        .into_inner();
    // The victim itself receives its memory: the refusals below are the
    // peer check's, not a broken socket.
    let slot_socket = socket_path(agent.socket());
    let mine = fetch(&slot_socket, me.generation, FETCH_WAIT).expect("the rank's own memory");
    let mine = SlotMemory::open(mine).expect("sealed, with a good header");
    assert_eq!(mine.slot().generation(), me.generation);

    let u = users::users();
    for (who, register) in [(&u.member, true), (&u.stranger, false)] {
        let args =
            json!({"socket": agent.socket(), "generation": me.generation, "register": register});
        let who = who.clone();
        let out = within(WAIT * 6, "the attack", async move {
            tokio::task::spawn_blocking(move || users::run_as(&who, "slots.steal", &args))
                .await
                .expect("run the attack")
        })
        .await
        .result;
        assert_eq!(out["theft"]["got_fd"], json!(false), "{out}");
        for n in out["neighbours"].as_array().expect("neighbours") {
            assert_eq!(n["got_fd"], json!(false), "{out}");
        }
        assert_eq!(out["slot_files"], json!([]), "no slot file to open: {out}");
        if register {
            // In the group: it reaches the socket and is refused by name.
            let why = out["theft"]["refused"].as_str().unwrap_or_default();
            assert!(why.contains("this connection is from uid"), "{out}");
            let own = &out["own"];
            assert_eq!(own["generation"], own["expected"], "{out}");
            assert_eq!(own["shrink_errno"], json!(libc::EPERM), "{out}");
            assert_eq!(own["grow_errno"], json!(libc::EPERM), "{out}");
        } else {
            // Outside it: the socket itself is closed to it.
            assert_eq!(out["theft"]["io"], json!("connect"), "{out}");
            assert_eq!(out["theft"]["errno"], json!(libc::EACCES), "{out}");
        }
    }
    // The victim's slot is untouched and still its own.
    assert_eq!(mine.slot().generation(), me.generation);
    let ranks = c
        .get_ranks(pb::GetRanksRequest {
            job_id: "victim-slots".into(),
        })
        .await
        .expect("GetRanks")
        .into_inner()
        .ranks;
    assert_eq!(ranks.len(), 1, "{ranks:?}");
    assert_eq!(ranks[0].state, "running", "{ranks:?}");
}
