//! The durable tier: complete steps in object storage (object_store crate).
//!
//! `file://` (tests, an NFS mount), `s3://`, `gs://`. A shard is uploaded
//! as its bytes and then its manifest, so, as in the local tier, a shard is
//! there exactly when its manifest is. Downloads are checked against the
//! manifest before they are used.

use std::path::Path;
use std::sync::Arc;

use object_store::ObjectStore;
use object_store::path::Path as ObjPath;
use tokio::io::AsyncWriteExt;
use xxhash_rust::xxh3::Xxh3;

use super::layout::{self, ShardKey};
use super::manifest::{self, Manifest};

/// Opens the store a URL names; credentials from the environment.
pub fn parse(url: &str) -> Result<(Arc<dyn ObjectStore>, ObjPath), String> {
    let u = url::Url::parse(url).map_err(|e| format!("not a URL: {e}"))?;
    match u.scheme() {
        "file" | "s3" | "s3a" | "gs" => {}
        other => {
            return Err(format!(
                "scheme {other:?} is not supported: use file://, s3:// or gs://"
            ));
        }
    }
    let env = std::env::vars().map(|(k, v)| (k.to_ascii_lowercase(), v));
    let (store, prefix) = object_store::parse_url_opts(&u, env).map_err(|e| e.to_string())?;
    Ok((Arc::from(store), prefix))
}

/// The configured durable store.
#[derive(Debug)]
pub struct Durable {
    store: Arc<dyn ObjectStore>,
    prefix: ObjPath,
    url: String,
}

impl Durable {
    /// Opens `url`.
    pub fn open(url: &str) -> Result<Self, String> {
        let (store, prefix) = parse(url)?;
        Ok(Self {
            store,
            prefix,
            url: url.to_owned(),
        })
    }

    /// The URL, for listings and logs.
    pub fn url(&self) -> &str {
        &self.url
    }

    fn path(&self, rel: &str) -> ObjPath {
        let p = self.prefix.as_ref();
        if p.is_empty() {
            ObjPath::from(rel)
        } else {
            ObjPath::from(format!("{p}/{rel}"))
        }
    }

    /// Uploads a shard's bytes (`data`, opened by the tier), then its
    /// manifest.
    pub async fn upload(&self, m: &Manifest, data: std::fs::File) -> Result<(), String> {
        let key = m.key();
        let dest = self.path(&layout::durable_key(&key, false));
        let mut src = tokio::fs::File::from_std(data);
        let mut w = object_store::buffered::BufWriter::new(self.store.clone(), dest.clone());
        tokio::io::copy(&mut src, &mut w)
            .await
            .map_err(|e| format!("uploading {key} to {}: {e}", self.url))?;
        w.shutdown()
            .await
            .map_err(|e| format!("uploading {key} to {}: {e}", self.url))?;
        let body = serde_json::to_vec_pretty(m).map_err(|e| e.to_string())?;
        self.store
            .put(&self.path(&layout::durable_key(&key, true)), body.into())
            .await
            .map_err(|e| format!("uploading the manifest of {key} to {}: {e}", self.url))?;
        Ok(())
    }

    /// Every shard of `job` whose manifest is in the store.
    pub async fn list(&self, job: &str) -> Result<Vec<Manifest>, String> {
        use tokio_stream::StreamExt;
        let prefix = self.path(job);
        let mut listing = self.store.list(Some(&prefix));
        let mut out = Vec::new();
        while let Some(meta) = listing.next().await {
            let meta = meta.map_err(|e| format!("listing {}: {e}", self.url))?;
            if meta.location.extension() != Some("json") {
                continue;
            }
            let bytes = match self.store.get(&meta.location).await {
                Ok(g) => g.bytes().await,
                Err(e) => Err(e),
            };
            match bytes
                .map_err(|e| e.to_string())
                .and_then(|b| Manifest::parse(&b))
            {
                Ok(m) if m.job_id == job => out.push(m),
                Ok(_) => {}
                Err(e) => tracing::warn!(object = %meta.location, error = %e,
                    "durable checkpoint manifest left out"),
            }
        }
        out.sort_by_key(Manifest::key);
        Ok(out)
    }

    /// Which ranks of `job` the store holds, per step, from the objects'
    /// names (a LIST, no manifest read: a shard's manifest is there exactly
    /// when the shard is), and each step's world size from one manifest of
    /// the step. The collector's share of a restore
    /// ([`super::collect`]): once per collection, where every restoring
    /// host reading every manifest was O(N) requests a host.
    pub async fn ranks(&self, job: &str) -> Result<Vec<(u64, u32, Vec<u32>)>, String> {
        use tokio_stream::StreamExt;
        let prefix = self.path(job);
        let mut listing = self.store.list(Some(&prefix));
        let mut steps: std::collections::BTreeMap<u64, Vec<(u32, ObjPath)>> = Default::default();
        while let Some(meta) = listing.next().await {
            let meta = meta.map_err(|e| format!("listing {}: {e}", self.url))?;
            let mut parts: Vec<_> = meta.location.parts().collect();
            let (Some(file), Some(dir)) = (parts.pop(), parts.pop()) else {
                continue;
            };
            let (Some(step), Some(rank)) = (
                layout::parse_step(dir.as_ref()),
                layout::parse_manifest_rank(file.as_ref()),
            ) else {
                continue;
            };
            steps.entry(step).or_default().push((rank, meta.location));
        }
        let mut out = Vec::with_capacity(steps.len());
        for (step, mut ranks) in steps {
            ranks.sort_by_key(|(r, _)| *r);
            let Some((_, first)) = ranks.first() else {
                continue;
            };
            // A step whose manifest cannot be read is left out (a step with
            // no world size cannot count as complete), and said so.
            let world = match self.read_manifest(first).await {
                Ok(m) => m.world_size,
                Err(e) => {
                    tracing::warn!(job, step, error = %e, "durable step left out of the count");
                    continue;
                }
            };
            out.push((step, world, ranks.into_iter().map(|(r, _)| r).collect()));
        }
        Ok(out)
    }

    /// The manifest of one shard, when the store holds it (one read).
    pub async fn manifest(&self, key: &ShardKey) -> Result<Option<Manifest>, String> {
        let at = self.path(&layout::durable_key(key, true));
        match self.store.get(&at).await {
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(format!("{key} from {}: {e}", self.url)),
            Ok(g) => {
                let b = g
                    .bytes()
                    .await
                    .map_err(|e| format!("{key} from {}: {e}", self.url))?;
                Manifest::parse(&b)
                    .map(Some)
                    .map_err(|e| format!("{key} from {}: {e}", self.url))
            }
        }
    }

    /// The steps of `job` the store has a directory for (one LIST with a
    /// delimiter: a page of step names, not the shards).
    pub async fn steps(&self, job: &str) -> Result<Vec<u64>, String> {
        let listed = self
            .store
            .list_with_delimiter(Some(&self.path(job)))
            .await
            .map_err(|e| format!("listing {}: {e}", self.url))?;
        let mut steps: Vec<u64> = listed
            .common_prefixes
            .iter()
            .filter_map(|p| p.filename().and_then(layout::parse_step))
            .collect();
        steps.sort_unstable();
        Ok(steps)
    }

    async fn read_manifest(&self, at: &ObjPath) -> Result<Manifest, String> {
        let b = match self.store.get(at).await {
            Ok(g) => g.bytes().await,
            Err(e) => Err(e),
        }
        .map_err(|e| format!("{at} from {}: {e}", self.url))?;
        Manifest::parse(&b).map_err(|e| format!("{at} from {}: {e}", self.url))
    }

    /// Downloads a shard into `dest` (a staging file the tier created, at
    /// `path`), checked against `m`; on failure the caller removes it.
    pub async fn fetch(
        &self,
        m: &Manifest,
        dest: std::fs::File,
        path: &Path,
    ) -> Result<(), String> {
        let (file, dest) = (dest, path);
        use tokio_stream::StreamExt;
        let key: ShardKey = m.key();
        let got = self
            .store
            .get(&self.path(&layout::durable_key(&key, false)))
            .await
            .map_err(|e| format!("{key} from {}: {e}", self.url))?;
        let mut stream = got.into_stream();
        let mut f = tokio::fs::File::from_std(file);
        let mut h = Xxh3::new();
        let mut size = 0u64;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| format!("{key} from {}: {e}", self.url))?;
            size += chunk.len() as u64;
            h.update(&chunk);
            f.write_all(&chunk)
                .await
                .map_err(|e| format!("{}: {e}", dest.display()))?;
        }
        f.flush()
            .await
            .map_err(|e| format!("{}: {e}", dest.display()))?;
        if size != m.size_bytes {
            return Err(format!(
                "corrupt: {key} from {}: {size} bytes, the manifest says {}",
                self.url, m.size_bytes
            ));
        }
        if manifest::hex(h.digest()) != m.xxh3 {
            return Err(format!(
                "corrupt: {key} from {}: xxh3 {}, the manifest says {}",
                self.url,
                manifest::hex(h.digest()),
                m.xxh3
            ));
        }
        Ok(())
    }
}
