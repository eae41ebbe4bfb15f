//! `warden`: the operator CLI. All of it lives in [`warden_agent::cli`].

fn main() -> std::process::ExitCode {
    match warden_agent::cli::main() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("warden: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
