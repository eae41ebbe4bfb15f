//! Generates the warden.v1 code from the .proto files at build time.
//!
//! protoc comes from the `protoc-bin-vendored` crate (a registry package), so a
//! fresh machine builds with cargo alone; `PROTOC` in the environment wins.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("PROTOC").is_none() {
        let protoc = protoc_bin_vendored::protoc_bin_path()?;
        // SAFETY: build scripts are single-threaded; nothing else reads the
        // environment concurrently.
        unsafe { std::env::set_var("PROTOC", protoc) };
    }
    let include = protoc_bin_vendored::include_path()?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    let protos = [
        "warden/v1/agent.proto",
        "warden/v1/peer.proto",
        "warden/v1/checkpoint.proto",
    ];
    for p in &protos {
        println!("cargo:rerun-if-changed={p}");
    }
    // Shard chunks as `bytes::Bytes`: decoding slices the received buffer
    // instead of copying each chunk into a Vec.
    tonic_prost_build::configure()
        .bytes(".warden.v1.ShardChunk.data")
        .file_descriptor_set_path(out_dir.join("warden_descriptor.bin"))
        .compile_protos(&protos, &[".", &include.to_string_lossy()])?;
    // Foreign protocols warden speaks (libtpu's runtime metrics, NVIDIA's
    // nvhcd): compiled apart, so they stay out of warden's reflection set.
    // Both are upstream's files as published (tpu_info/proto/ at tpu-info's
    // path, so its import is unedited; nvhcd/ as in nvidia-resiliency-ext):
    // the provenance is in each file's header and docs/dependencies.md.
    let foreign = [
        "tpu_info/proto/tpu_telemetry.proto",
        "tpu_info/proto/tpu_metric_service.proto",
        "nvhcd/nvhcd.proto",
    ];
    for p in &foreign {
        println!("cargo:rerun-if-changed={p}");
    }
    tonic_prost_build::configure().compile_protos(&foreign, &[".", &include.to_string_lossy()])?;
    Ok(())
}
