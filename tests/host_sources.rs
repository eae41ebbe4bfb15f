//! System tests of the host sources against the real `wardend`: NICs and
//! InfiniBand ports from a fake sysfs tree (`[host] sysfs_root`), free space
//! of the checkpoint tier (`[host] checkpoint_dir`).

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::time::Duration;

use common::{TestAgent, WAIT, eventually};
use warden_proto::v1 as pb;

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

fn nic(root: &Path, name: &str, physical: bool, operstate: &str, carrier: u8) {
    let dir = root.join("class/net").join(name);
    write(&dir.join("operstate"), &format!("{operstate}\n"));
    write(&dir.join("carrier"), &format!("{carrier}\n"));
    write(&dir.join("flags"), "0x1003\n");
    write(&dir.join("carrier_down_count"), "3\n");
    if physical {
        std::fs::create_dir_all(dir.join("device")).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nics_ib_ports_and_checkpoint_space() {
    let sys = tempfile::tempdir().unwrap();
    let ckpt = tempfile::tempdir().unwrap();
    let root = sys.path();
    nic(root, "eth0", true, "up", 1);
    nic(root, "eth1", true, "down", 0);
    nic(root, "veth1234", true, "up", 1);
    nic(root, "lo", false, "unknown", 1);
    let port = root.join("class/infiniband/mlx5_0/ports/1");
    write(&port.join("state"), "4: ACTIVE\n");
    write(&port.join("rate"), "400 Gb/sec (4X NDR)\n");
    write(&port.join("counters/link_downed"), "41\n");

    let agent = TestAgent::start(&format!(
        "[host]\npoll_interval = \"100ms\"\nsysfs_root = \"{}\"\ncheckpoint_dir = \"{}\"\n",
        root.display(),
        ckpt.path().display()
    ));

    let status = |c: &pb::Component| pb::Status::try_from(c.status).unwrap();
    let eth0 = eventually(WAIT, "nic/eth0", async || agent.component("nic/eth0").await).await;
    assert_eq!(status(&eth0), pb::Status::Ok, "{eth0:?}");
    let eth1 = eventually(WAIT, "nic/eth1", async || agent.component("nic/eth1").await).await;
    assert_eq!(status(&eth1), pb::Status::Failed, "{eth1:?}");
    assert_eq!(eth1.reasons[0].signal, "nic.link_state");
    let ib = eventually(WAIT, "ib port", async || {
        agent.component("ib/mlx5_0/1").await
    })
    .await;
    assert_eq!(
        status(&ib),
        pb::Status::Ok,
        "a lifetime total is no verdict: {ib:?}"
    );
    assert_eq!(ib.labels["rate"], "400 Gb/sec (4X NDR)");
    assert!(agent.component("nic/veth1234").await.is_none(), "virtual");
    assert!(agent.component("nic/lo").await.is_none(), "loopback");
    let disk = eventually(WAIT, "disk/checkpoint", async || {
        agent.component("disk/checkpoint").await
    })
    .await;
    assert_eq!(disk.labels["path"], ckpt.path().display().to_string());
    assert!(disk.labels.contains_key("available"), "{disk:?}");

    // The port goes down twice within the window: flapping.
    write(&port.join("counters/link_downed"), "42\n");
    tokio::time::sleep(Duration::from_millis(300)).await;
    write(&port.join("counters/link_downed"), "43\n");
    let ib = eventually(WAIT, "ib port DEGRADED", async || {
        agent
            .component("ib/mlx5_0/1")
            .await
            .filter(|c| status(c) == pb::Status::Degraded)
    })
    .await;
    assert_eq!(ib.reasons[0].signal, "ib.link_downs");
    assert_eq!(ib.reasons[0].window, "5m");
    let flap = eventually(WAIT, "net.link_flap", async || {
        agent
            .events()
            .await
            .into_iter()
            .find(|e| e.kind == "net.link_flap")
    })
    .await;
    assert_eq!(flap.subject, "ib/mlx5_0/1");

    // And down now: FAILED.
    write(&port.join("state"), "1: DOWN\n");
    eventually(WAIT, "ib port FAILED", async || {
        agent
            .component("ib/mlx5_0/1")
            .await
            .filter(|c| status(c) == pb::Status::Failed)
    })
    .await;
}
