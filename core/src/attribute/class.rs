//! The classes and the signal rules' shape, as attribution names them:
//! both live in the shared vocabulary ([`crate::verdict`]), which the fault
//! tables (`taxonomy`) import too, so that neither imports attribution.

pub use crate::verdict::{FaultClass, SignalRule};
