//! The launcher `warden run` (being written).
