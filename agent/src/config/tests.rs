use super::*;

fn err(text: &str) -> String {
    Config::from_toml(text, "test.toml")
        .unwrap_err()
        .to_string()
}

#[test]
fn empty_file_is_the_defaults() {
    assert_eq!(Config::from_toml("", "t").unwrap(), Config::default());
}

#[test]
fn defaults_round_trip_through_toml() {
    let text = Config::default().to_toml();
    assert_eq!(Config::from_toml(&text, "t").unwrap(), Config::default());
}

/// The simulated node's section is printed, set or not (the shipped config
/// documents every key as `--print-config` shows it), and read back.
#[test]
fn the_simulated_section_is_printed_and_read_back() {
    let mut c = Config::default();
    c.simulated.scenario = "/etc/warden/node.toml".into();
    let text = c.to_toml();
    assert!(text.contains("[simulated]"), "{text}");
    assert_eq!(Config::from_toml(&text, "t").unwrap(), c);
}

#[test]
fn unknown_key_is_named() {
    let e = err("[api]\nsockt = \"/x\"\n");
    assert!(e.contains("sockt"), "{e}");
    assert!(e.contains("api"), "{e}");
}

#[test]
fn unknown_section_is_named() {
    let e = err("[apii]\n");
    assert!(e.contains("apii"), "{e}");
}

#[test]
fn wrong_type_names_the_dotted_key() {
    let e = err("[events]\nretain = \"many\"\n");
    assert!(e.contains("key `events.retain`"), "{e}");
}

#[test]
fn bad_duration_names_key_and_form() {
    let e = err("[agent]\ntick = \"fast\"\n");
    assert!(e.contains("agent.tick"), "{e}");
    assert!(e.contains("100ms"), "{e}");
}

#[test]
fn out_of_range_values_are_refused_with_the_key() {
    for (text, key) in [
        ("[agent]\ntick = \"5s\"\n", "agent.tick"),
        ("[api]\ntcp = \"localhost\"\n", "api.tcp"),
        ("[api]\nsocket = \"rel/x.sock\"\n", "api.socket"),
        ("[api]\nsocket_mode = \"0999\"\n", "api.socket_mode"),
        ("[api]\nsocket_mode = \"0666\"\n", "api.socket_mode"),
        ("[api]\nsocket_mode = \"0777\"\n", "api.socket_mode"),
        ("[api]\nsocket_mode = \"0661\"\n", "api.socket_mode"),
        (
            "[api]\nsocket_group = \"no-such-group-warden\"\n",
            "api.socket_group",
        ),
        (
            "[api]\nadmin_group = \"no-such-group-warden\"\n",
            "api.admin_group",
        ),
        ("[ranks]\nmax_per_process = 0\n", "ranks.max_per_process"),
        (
            "[ranks]\nmax_ranks_per_uid = 300\n",
            "ranks.max_ranks_per_uid",
        ),
        (
            "[api]\nmax_connections_per_uid = 0\n",
            "api.max_connections_per_uid",
        ),
        ("[api]\nmax_connections = 0\n", "api.max_connections"),
        (
            "[straggler]\naggregator_fan_out = 1\n",
            "straggler.aggregator_fan_out",
        ),
        (
            "[straggler]\naggregator_fan_out = 65537\n",
            "straggler.aggregator_fan_out",
        ),
        (
            "[api]\nmax_requests_per_uid = 0\n",
            "api.max_requests_per_uid",
        ),
        (
            "[api]\nmax_handshakes_per_source = 0\n",
            "api.max_handshakes_per_source",
        ),
        (
            "[metrics]\nmax_connections_per_source = 0\n",
            "metrics.max_connections_per_source",
        ),
        ("[api]\npreface_timeout = \"1ms\"\n", "api.preface_timeout"),
        ("[api]\nidle_timeout = \"100ms\"\n", "api.idle_timeout"),
        ("[api]\nmax_streams = 0\n", "api.max_streams"),
        ("[api]\nmax_streams = 100000\n", "api.max_streams"),
        (
            "[api]\nmax_streams_per_uid = 600\n",
            "api.max_streams_per_uid",
        ),
        ("[ranks]\nmax_world_size = 0\n", "ranks.max_world_size"),
        ("[metrics]\nlisten = \"nope\"\n", "metrics.listen"),
        ("[log]\nlevel = \"[[[\"\n", "log.level"),
        ("[events]\nretain = 0\n", "events.retain"),
        ("[ranks]\nmax_ranks = 0\n", "ranks.max_ranks"),
        ("[hang]\nmultiplier = 0.5\n", "hang.multiplier"),
        ("[hang]\nfloor = \"1ms\"\n", "hang.floor"),
        ("[hang]\nwarmup_samples = 0\n", "hang.warmup_samples"),
        ("[hang.timeouts]\nstep = \"1ms\"\n", "hang.timeouts"),
        (
            "[host]\nmemory_failed_below_percent = 50.0\n",
            "host.memory_failed_below_percent",
        ),
        (
            "[host]\nmemory_degraded_below_percent = 150.0\n",
            "host.memory_degraded_below_percent",
        ),
    ] {
        let e = err(text);
        assert!(e.contains(key), "{text:?} gave {e}");
    }
}

#[test]
fn log_format_is_checked() {
    let e = err("[log]\nformat = \"xml\"\n");
    assert!(e.contains("log.format"), "{e}");
}

#[test]
fn syntax_error_is_reported_on_one_line() {
    let e = err("[api\n");
    assert!(!e.contains('\n'), "{e}");
    assert!(e.contains("test.toml"), "{e}");
}

#[test]
fn socket_mode_parses_octal() {
    let mut c = Config::default();
    assert_eq!(c.socket_mode(), Some(0o660));
    c.api.socket_mode = "600".into();
    assert_eq!(c.socket_mode(), Some(0o600));
}

#[test]
fn hang_timeouts_table_parses() {
    let c = Config::from_toml(
        "[hang.timeouts]\ncheckpoint = \"45m\"\nstep = \"30s\"\n",
        "t",
    )
    .unwrap();
    assert_eq!(c.hang.timeouts["step"], Duration::from_secs(30));
    let e = err("[hang.timeouts]\nstep = \"soon\"\n");
    assert!(e.contains("hang.timeouts"), "{e}");
}

#[test]
fn tcp_and_peers_need_tls_or_an_explicit_insecure() {
    const TLS: &str = "tls_ca = \"/t/ca.crt\"\ntls_cert = \"/t/n.crt\"\ntls_key = \"/t/n.key\"\n";
    for (text, key, says) in [
        (
            "[api]\ntcp = \"127.0.0.1:7070\"\n",
            "api.tcp",
            "api.insecure = true",
        ),
        (
            "[checkpoint]\n[[checkpoint.peers]]\naddr = \"10.0.0.2:7070\"\n",
            "checkpoint.peers",
            "api.tls_ca",
        ),
        (
            "[straggler]\npeers = [\"10.0.0.2:7070\"]\n",
            "straggler.peers",
            "api.tls_ca",
        ),
        (
            "[api]\ntls_ca = \"/t/ca.crt\"\n",
            "api.tls_cert",
            "all three",
        ),
        ("[api]\ntls_ca = \"ca.crt\"\n", "api.tls_ca", "absolute"),
        (
            &format!("[api]\n{TLS}insecure = true\n"),
            "api.insecure",
            "TLS files are set",
        ),
        (
            &format!("[api]\n{TLS}[[checkpoint.peers]]\naddr = \"10.0.0.2:7070\"\n"),
            "checkpoint.peers.name",
            "certificate",
        ),
    ] {
        let e = err(text);
        assert!(e.contains(key), "{key}: {e}");
        assert!(e.contains(says), "{key}: {e}");
    }
    for ok in [
        "[api]\ntcp = \"127.0.0.1:7070\"\ninsecure = true\n".to_owned(),
        format!(
            "[api]\ntcp = \"127.0.0.1:7070\"\n{TLS}[[checkpoint.peers]]\naddr = \"10.0.0.2:7070\"\nname = \"n2\"\n"
        ),
    ] {
        assert!(Config::from_toml(&ok, "t").is_ok(), "{ok}");
    }
}
