//! The remediation policy's one part with I/O: running the user's hook. The
//! policy itself (actions, budgets, the hook's protocol) is
//! [`warden_core::policy`].

pub mod hook;
