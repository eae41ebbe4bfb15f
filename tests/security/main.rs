//! Security tests: each attack of issue 18 replayed as a real unprivileged
//! user against a real wardend, and shown refused with nothing changed.
//!
//! In: root (the tests create the users of [`common::users`]). Out: one
//! module per surface. Never: runs attack code as root — an attack runs in
//! a copy of this binary re-executed as the user, through `attacker` below.

// A test that cannot do its job panics, which fails it.
#![allow(clippy::expect_used, clippy::unwrap_used)]

#[path = "../common/mod.rs"]
mod common;

mod agent_setup;
mod authz;
mod belief;
mod files;
mod floods;
mod gates;
mod launcher_files;
mod output;
mod ownership;
mod slots;
mod state_files;
mod tls;

/// Every attack a test may run as another user: `("area.what", fn)`.
const ATTACKS: &[(&str, common::users::Attack)] = &[
    ("socket.info", files::attack_info),
    ("authz.everything", authz::attack_everything),
    ("authz.stack_file", authz::attack_stack_file),
    ("files.read_via_staging", files::attack_read_via_staging),
    ("files.plant_staging", files::attack_plant_staging),
    ("files.save_restore", files::attack_save_restore),
    ("slots.steal", slots::attack_slots),
    ("floods.control", floods::attack_control),
    ("floods.connections", floods::attack_connections),
    ("floods.ranks", floods::attack_ranks),
    ("floods.rank_holder", floods::attack_rank_holder),
    ("floods.requests", floods::attack_requests),
    ("output.escapes", output::attack_escapes),
    ("belief.fake_crashes", belief::attack_fake_crashes),
    ("belief.stop_flood", belief::attack_stop_flood),
    ("gates.gate", gates::attack_gates),
    ("gates.stop_flood", gates::attack_stop_flood),
    ("gates.cycles", gates::attack_cycles),
    ("gates.claims", gates::attack_claims),
    ("ownership.squat", ownership::attack_squat),
    ("ownership.running", ownership::attack_running),
    ("ownership.take_over", ownership::attack_take_over),
    (
        "launcher_files.plant_logs",
        launcher_files::attack_plant_logs,
    ),
    (
        "launcher_files.plant_modules",
        launcher_files::attack_plant_modules,
    ),
    ("setup.nvhcd", agent_setup::attack_nvhcd),
    ("state.flight", state_files::attack_flight),
    ("state.fill", state_files::attack_fill),
    ("state.staging_grow", state_files::attack_staging_grow),
    ("state.claims", state_files::attack_claims),
    ("state.save", state_files::attack_save),
    ("belief.forged_values", belief::attack_forged_values),
];

/// Does nothing in a normal run; in a process started by
/// [`common::users::run_as`], runs the attack it names.
#[test]
fn attacker() {
    common::users::dispatch(ATTACKS);
}
