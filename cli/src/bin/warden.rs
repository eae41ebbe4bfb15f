//! `warden`: the operator CLI. All of it lives in [`warden_cli`].

fn main() -> std::process::ExitCode {
    // `warden run` may embed the agent, whose DCGM source runs the library
    // in a helper process started from this same executable.
    if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == "--dcgm-helper")
    {
        let code = warden_agent::sources::dcgm::helper::main();
        return std::process::ExitCode::from(u8::try_from(code).unwrap_or(1));
    }
    match warden_cli::main() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // `warden ckpt ls | head`: the reader has what it wanted.
        Err(e) if warden_cli::is_broken_pipe(&e) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("warden: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
