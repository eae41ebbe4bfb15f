//! warden's core: what a fault is and what to do about it, with no I/O of
//! the network kind and no knowledge of gRPC.
//!
//! The health model, the fault taxonomy (XID table, DCGM incident codes),
//! the detectors (hangs, stragglers), the attribution engine and its rules,
//! the remediation policy, the vocabulary those two share (`verdict`: fault
//! class, action, decision), the goodput ledger and the typed signals the
//! stages tell each other. The agent (`warden-agent`) feeds it from the
//! sources and the ranks and carries its decisions out; the launcher and the
//! CLI sit above that. The compiler holds the layering: this crate depends
//! on none of them, nor on tonic, prost or etcd.
//!
//! What it does touch: files under the agent's state directory through
//! [`fsafe`] (hang calibration, goodput journals, the incident store) and
//! operator-named files through [`named_file`], both synchronous and bounded.
//!
//! # Layout
//! - [`health`]: the health model: components, reasons, windows.
//! - [`taxonomy`]: what the vendors' codes mean (the XID table, DCGM's
//!   incident codes).
//! - [`detect`]: the detectors: hangs, stragglers, SDC, culprits.
//! - [`signal`], [`events`]: the typed signals the stages tell each other
//!   (and a producer's untyped notice), and the bus that carries and
//!   renders them, with the health reporter that speaks on it.
//! - [`attribute`]: the attribution engine, its evidence rules and combiner,
//!   the incident store.
//! - [`verdict`]: the vocabulary attribution, policy and the signals share
//!   (fault class, action, decision, exit statuses, the incident record and
//!   its diagnosis, a hang verdict's blame).
//! - [`policy`]: what to do about a diagnosis: budgets, guards, the hook's
//!   contract.
//! - [`goodput`]: the goodput ledger and its journal.
//! - [`device`], [`rank`]: typed device ids; rank keys and world limits.
//! - [`config`]: the config vocabulary every stage's section uses.
//! - [`fsafe`], [`named_file`]: the agent's own files, and files an
//!   operator names.
//! - [`text`]: names and lines from outside, checked or clipped.

pub mod attribute;
pub mod config;
pub mod detect;
pub mod device;
pub mod events;
pub mod fsafe;
pub mod goodput;
pub mod health;
pub mod named_file;
pub mod policy;
pub mod rank;
pub mod signal;
pub mod taxonomy;
pub mod text;
pub mod verdict;
