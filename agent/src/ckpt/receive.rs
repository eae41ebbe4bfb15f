//! A shard's bytes arriving from a peer (a replica pushed here, a copy
//! fetched for a restore), written into a staging file and checked against
//! what its manifest announced before anything is committed.
//!
//! The bytes come through [`ShardStream`], which the transport implements
//! for its framings (`peer_link`): this module names no wire type.

use std::path::PathBuf;

use bytes::Bytes;
use xxhash_rust::xxh3::Xxh3;

use super::manifest::{self, Manifest};

/// The rest of a shard's bytes after its first chunk, in order, as the
/// transport delivers them.
#[async_trait::async_trait]
pub trait ShardStream: Send {
    /// The next chunk's bytes; None at the end; a broken stream's cause.
    async fn next_data(&mut self) -> Result<Option<Vec<Bytes>>, String>;
}

/// Receives a shard's chunks into `dest` (a staging file the tier created,
/// at `path`), checking them against `want` (size and xxh3). On any
/// mismatch the error names what differed (the caller removes the file). Writing and hashing run on two blocking threads
/// fed the same buffers (reference-counted, not copied), overlapped with
/// receiving: on a host with cores to spare the checksum costs no time on
/// the transfer's path, where one thread doing both made it the slowest
/// stage of the pipeline.
pub async fn receive(
    stream: &mut (impl ShardStream + ?Sized),
    first_data: Vec<Bytes>,
    want: &Manifest,
    dest: std::fs::File,
    path: PathBuf,
) -> Result<(), String> {
    // On failure the caller's guard removes the staging file.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<Bytes>>(8);
    let (hash_tx, mut hash_rx) = tokio::sync::mpsc::channel::<Vec<Bytes>>(8);
    let writer = tokio::task::spawn_blocking(move || -> Result<u64, String> {
        let mut f = dest;
        let mut size = 0u64;
        while let Some(parts) = rx.blocking_recv() {
            for data in parts {
                size += data.len() as u64;
                std::io::Write::write_all(&mut f, &data)
                    .map_err(|e| format!("{}: {e}", path.display()))?;
            }
        }
        Ok(size)
    });
    let hasher = tokio::task::spawn_blocking(move || {
        let mut h = Xxh3::new();
        while let Some(parts) = hash_rx.blocking_recv() {
            for data in parts {
                h.update(&data);
            }
        }
        h.digest()
    });
    let mut received = 0u64;
    let mut data = first_data;
    let mut broke = None;
    loop {
        received += data.iter().map(|b| b.len() as u64).sum::<u64>();
        if received > want.size_bytes {
            broke = Some(format!(
                "corrupt: {}: more than the {} bytes announced",
                want.key(),
                want.size_bytes
            ));
            break;
        }
        if hash_tx.send(data.clone()).await.is_err() || tx.send(data).await.is_err() {
            break; // the writer failed: its error is below
        }
        match stream.next_data().await {
            Ok(Some(d)) => data = d,
            Ok(None) => break,
            Err(why) => {
                broke = Some(format!("{}: stream broke: {why}", want.key()));
                break;
            }
        }
    }
    drop(tx);
    drop(hash_tx);
    let size = writer.await.map_err(|e| e.to_string())??;
    let got = hasher.await.map_err(|e| e.to_string())?;
    if let Some(why) = broke {
        return Err(why);
    }
    if size != want.size_bytes {
        return Err(format!(
            "corrupt: {}: {size} bytes arrived, {} were announced",
            want.key(),
            want.size_bytes
        ));
    }
    if manifest::hex(got) != want.xxh3 {
        return Err(format!(
            "corrupt: {}: arrived with xxh3 {}, expected {}",
            want.key(),
            manifest::hex(got),
            want.xxh3
        ));
    }
    Ok(())
}
