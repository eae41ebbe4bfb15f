//! Python bindings (module `warden._native`), filled in below.
