//! Files (issue 18, point 1): what a member of the socket group can make
//! the root agent read, write or follow in its checkpoint tier, state dir
//! and slot dir. Each attack runs as [`users::MEMBER`] in its own process.

use serde_json::{Value, json};
use warden_proto::v1 as pb;
use warden_proto::v1::agent_client::AgentClient;

use crate::common::users::{self, block_on, call_result, socket_arg};
use crate::common::{TestAgent, WAIT, within};

/// A client of the agent at the socket the arguments name.
async fn agent(args: &Value) -> Result<AgentClient<tonic::transport::Channel>, tonic::Status> {
    warden_agent::cli::Target::Unix(socket_arg(args))
        .channel()
        .await
        .map(AgentClient::new)
        .map_err(|e| tonic::Status::unavailable(format!("{e:#}")))
}

/// GetAgentInfo: does the socket let this user in at all?
pub fn attack_info(args: &Value) -> Value {
    block_on(async {
        let r = match agent(args).await {
            Ok(mut c) => c.get_agent_info(pb::GetAgentInfoRequest {}).await,
            Err(s) => Err(s),
        };
        call_result(r, |i| json!({"version": i.into_inner().version}))
    })
}

/// The socket group decides who connects: the member is answered, the
/// stranger is not (the harness works, and so does `api.socket_group`).
#[tokio::test(flavor = "multi_thread")]
async fn only_the_socket_group_connects() {
    let agent = TestAgent::start_shared("");
    let u = users::users();
    let args = json!({"socket": agent.socket()});
    let socket = agent.socket().to_owned();
    let meta = std::fs::metadata(&socket).expect("the socket");
    use std::os::unix::fs::MetadataExt;
    assert_eq!(meta.gid(), u.sock_gid, "api.socket_group chowns the socket");
    let (member, stranger) = within(WAIT * 6, "the two attack processes", async {
        tokio::task::spawn_blocking(move || {
            (
                users::run_as(&u.member, "socket.info", &args),
                users::run_as(&u.stranger, "socket.info", &args),
            )
        })
        .await
        .expect("run the attacks")
    })
    .await;
    assert_eq!(member.result["ok"], json!(true), "{member:?}");
    assert_eq!(stranger.result["ok"], json!(false), "{stranger:?}");
    assert!(
        stranger.str("message").contains("ermission denied"),
        "{stranger:?}"
    );
}
