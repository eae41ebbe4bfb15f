//! A job's checkpoint peers handed over in pages (`SetCheckpointPeers`
//! with `pages` > 1).
//!
//! The agent takes requests of at most 4 MiB (gRPC's default, kept so a
//! local caller cannot make it buffer more), and a job of 16,384 hosts
//! whose host ids and identities are as long as allowed is about 8 MB of
//! peers. So the launcher pages a long list, and the pages wait here until
//! the last one arrives; only then does the job's peer set change, all at
//! once, as with a list in one request.
//!
//! What a caller controls is bounded: the page count ([`MAX_PAGES`]), the
//! bytes waiting over every job ([`MAX_WAITING_BYTES`]), one list waiting
//! per job (a new page 0 replaces it), and a list left unfinished for
//! [`STALE`] is dropped. A page out of order is refused, never guessed at:
//! the launcher sends the list again from page 0.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::peerset::PeerSpec;

/// The most pages one list may have (a page is at most 4 MiB; the
/// launcher fills them to 2 MiB, 25,000 peers of ordinary names).
pub const MAX_PAGES: u32 = 64;
/// The most bytes of peers waiting for their last page, over every job.
pub const MAX_WAITING_BYTES: usize = 64 << 20;
/// How long an unfinished list waits for its next page.
pub const STALE: Duration = Duration::from_secs(60);

/// What a page made of the job's list.
#[derive(Debug, PartialEq, Eq)]
pub enum Paged {
    /// The whole list: set the job's peers to it.
    Done(Vec<PeerSpec>),
    /// More pages are to come.
    More,
}

/// Why a page was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PageError {
    /// `pages` past [`MAX_PAGES`].
    #[error("pages is {0}, more than the {MAX_PAGES} one peer list may have")]
    TooManyPages(u32),
    /// `page` not below `pages`.
    #[error("page {page} of a list of {pages} pages")]
    Beyond {
        /// The page.
        page: u32,
        /// The pages.
        pages: u32,
    },
    /// Not the page that was next for this list (or no list is waiting).
    #[error(
        "page {page} of list {list_id} of job {job:?} arrived where {expected}: send the list again from page 0"
    )]
    OutOfOrder {
        /// The job.
        job: String,
        /// The list.
        list_id: u64,
        /// The page.
        page: u32,
        /// What was expected, in words.
        expected: String,
    },
    /// The waiting pages would pass [`MAX_WAITING_BYTES`].
    #[error(
        "the peer lists waiting for their last page would hold more than {MAX_WAITING_BYTES} bytes; list {list_id} of job {job:?} is dropped"
    )]
    Full {
        /// The job.
        job: String,
        /// The list.
        list_id: u64,
    },
}

#[derive(Debug)]
struct Waiting {
    list_id: u64,
    pages: u32,
    next: u32,
    specs: Vec<PeerSpec>,
    bytes: usize,
    started: Instant,
}

/// The lists waiting for their last page, per job.
#[derive(Debug, Default)]
pub struct PeerPages {
    waiting: Mutex<HashMap<String, Waiting>>,
}

/// What a spec holds in memory, as counted against [`MAX_WAITING_BYTES`].
fn bytes_of(specs: &[PeerSpec]) -> usize {
    specs
        .iter()
        .map(|s| {
            std::mem::size_of::<PeerSpec>()
                + s.addr.len()
                + s.domain.len()
                + s.host.len()
                + s.identity.len()
        })
        .sum()
}

impl PeerPages {
    /// Takes page `page` of `pages` of list `list_id` of `job`'s peers.
    /// `pages` 0 or 1: `specs` is the whole list (and any list waiting for
    /// the job is dropped).
    pub fn take(
        &self,
        job: &str,
        list_id: u64,
        page: u32,
        pages: u32,
        specs: Vec<PeerSpec>,
    ) -> Result<Paged, PageError> {
        let mut waiting = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        waiting.retain(|_, w| now.duration_since(w.started) < STALE);
        if pages > MAX_PAGES {
            waiting.remove(job);
            return Err(PageError::TooManyPages(pages));
        }
        if page >= pages.max(1) {
            waiting.remove(job);
            return Err(PageError::Beyond { page, pages });
        }
        if pages <= 1 {
            waiting.remove(job);
            return Ok(Paged::Done(specs));
        }
        let bytes = bytes_of(&specs);
        let mut w = if page == 0 {
            waiting.remove(job);
            Waiting {
                list_id,
                pages,
                next: 0,
                specs: Vec::new(),
                bytes: 0,
                started: now,
            }
        } else {
            match waiting.remove(job) {
                Some(w) if w.list_id == list_id && w.pages == pages && w.next == page => w,
                Some(w) => {
                    return Err(PageError::OutOfOrder {
                        job: job.to_owned(),
                        list_id,
                        page,
                        expected: format!(
                            "page {} of list {} of {} pages was next",
                            w.next, w.list_id, w.pages
                        ),
                    });
                }
                None => {
                    return Err(PageError::OutOfOrder {
                        job: job.to_owned(),
                        list_id,
                        page,
                        expected: format!(
                            "no list was waiting (its page 0 never came, or it waited past {} s)",
                            STALE.as_secs()
                        ),
                    });
                }
            }
        };
        let others: usize = waiting.values().map(|o| o.bytes).sum();
        if others + w.bytes + bytes > MAX_WAITING_BYTES {
            return Err(PageError::Full {
                job: job.to_owned(),
                list_id,
            });
        }
        w.specs.extend(specs);
        w.bytes += bytes;
        w.next = page + 1;
        if w.next == w.pages {
            return Ok(Paged::Done(w.specs));
        }
        waiting.insert(job.to_owned(), w);
        Ok(Paged::More)
    }

    /// Lists waiting now (for tests and the status).
    pub fn waiting(&self) -> usize {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specs(from: usize, n: usize) -> Vec<PeerSpec> {
        (from..from + n)
            .map(|i| PeerSpec {
                addr: format!("10.0.{}.{}:7411", i / 256, i % 256),
                domain: String::new(),
                host: format!("h{i}"),
                identity: format!("h{i}"),
                ..Default::default()
            })
            .collect()
    }

    #[test]
    fn a_list_in_one_request_is_done_at_once() {
        let p = PeerPages::default();
        assert_eq!(
            p.take("j", 0, 0, 0, specs(0, 3)),
            Ok(Paged::Done(specs(0, 3)))
        );
        assert_eq!(
            p.take("j", 7, 0, 1, specs(0, 2)),
            Ok(Paged::Done(specs(0, 2)))
        );
        assert_eq!(p.waiting(), 0);
    }

    #[test]
    fn pages_in_order_make_the_whole_list_only_at_the_last() {
        let p = PeerPages::default();
        assert_eq!(p.take("j", 5, 0, 3, specs(0, 10)), Ok(Paged::More));
        assert_eq!(p.take("j", 5, 1, 3, specs(10, 10)), Ok(Paged::More));
        assert_eq!(p.waiting(), 1);
        assert_eq!(
            p.take("j", 5, 2, 3, specs(20, 5)),
            Ok(Paged::Done(specs(0, 25)))
        );
        assert_eq!(p.waiting(), 0);
    }

    #[test]
    fn a_page_out_of_order_or_of_another_list_is_refused_and_page_0_starts_over() {
        let p = PeerPages::default();
        assert!(matches!(
            p.take("j", 5, 1, 3, specs(0, 1)),
            Err(PageError::OutOfOrder { .. })
        ));
        assert_eq!(p.take("j", 5, 0, 3, specs(0, 1)), Ok(Paged::More));
        let skipped = p.take("j", 5, 2, 3, specs(2, 1)).unwrap_err();
        assert!(
            skipped
                .to_string()
                .contains("page 1 of list 5 of 3 pages was next"),
            "{skipped}"
        );
        // The refusal dropped the list: page 1 now finds none.
        assert!(p.take("j", 5, 1, 3, specs(1, 1)).is_err());
        assert_eq!(p.take("j", 6, 0, 2, specs(0, 1)), Ok(Paged::More));
        assert!(
            p.take("j", 5, 1, 2, specs(1, 1)).is_err(),
            "a page of an older list"
        );
        assert_eq!(
            p.take("j", 6, 0, 2, specs(0, 1)),
            Ok(Paged::More),
            "page 0 again starts over"
        );
        assert_eq!(
            p.take("j", 6, 1, 2, specs(1, 1)),
            Ok(Paged::Done(specs(0, 2)))
        );
        // Jobs wait apart.
        assert_eq!(p.take("a", 1, 0, 2, specs(0, 1)), Ok(Paged::More));
        assert_eq!(p.take("b", 1, 0, 2, specs(5, 1)), Ok(Paged::More));
        assert_eq!(
            p.take("a", 1, 1, 2, specs(1, 1)),
            Ok(Paged::Done(specs(0, 2)))
        );
        assert_eq!(p.waiting(), 1);
    }

    #[test]
    fn counts_and_bytes_a_caller_controls_are_bounded() {
        let p = PeerPages::default();
        assert_eq!(
            p.take("j", 1, 0, MAX_PAGES + 1, specs(0, 1)),
            Err(PageError::TooManyPages(MAX_PAGES + 1))
        );
        assert_eq!(
            p.take("j", 1, 3, 3, specs(0, 1)),
            Err(PageError::Beyond { page: 3, pages: 3 })
        );
        assert_eq!(
            p.take("j", 1, 2, 0, specs(0, 1)),
            Err(PageError::Beyond { page: 2, pages: 0 })
        );
        // One peer with a 1 MiB host id per page: 64 MiB passes the bound
        // over many jobs.
        let big = |i: usize| {
            vec![PeerSpec {
                addr: "10.0.0.1:7411".into(),
                domain: String::new(),
                host: "h".repeat(1 << 20),
                identity: format!("x{i}"),
                ..Default::default()
            }]
        };
        let mut refused = None;
        for i in 0..80 {
            if let Err(e) = p.take(&format!("job{i}"), 1, 0, 2, big(i)) {
                refused = Some((i, e));
                break;
            }
        }
        let (at, e) = refused.expect("the waiting bytes are bounded");
        assert!(at < 64, "refused at list {at}");
        assert!(matches!(e, PageError::Full { .. }), "{e}");
        assert!(p.waiting() <= 64);
    }
}
