//! warden's gRPC API, generated at build time from `proto/warden/v1/*.proto`.
//!
//! Nothing but the .proto files and the generated code lives here, so the
//! agent, the client library and third-party tools share one definition of
//! the wire format.

#![allow(missing_docs, clippy::all)]

/// Package `warden.v1`: the node agent's API.
pub mod v1 {
    tonic::include_proto!("warden.v1");

    /// The encoded file descriptor set, for gRPC server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("warden_descriptor");
}

/// Package `tpu.monitoring.runtime`: libtpu's runtime metrics service
/// (`proto/tpu_info/proto/`, transcribed from tpu-info), which the TPU
/// source polls.
pub mod tpu {
    /// `tpu.monitoring`.
    pub mod monitoring {
        /// `tpu.monitoring.runtime`.
        pub mod runtime {
            tonic::include_proto!("tpu.monitoring.runtime");
        }
    }
}

/// Package `tpu_telemetry`: per-core state in GetTpuRuntimeStatus answers.
pub mod tpu_telemetry {
    tonic::include_proto!("tpu_telemetry");
}

/// Package `nvhcd`: NVIDIA's node health check protocol, served by wardend
/// for nvidia-resiliency-ext (`proto/nvhcd/`).
pub mod nvhcd {
    tonic::include_proto!("nvhcd");
}
