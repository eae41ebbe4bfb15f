/*
 * warden.h: the C ABI of the warden client (libwarden_client.so / .a).
 *
 * A training rank connects once, then reports progress with calls that are
 * a few atomic stores into shared memory: no syscall, no lock, no
 * allocation. No call ever fails or blocks because of the agent: with no
 * agent (or after losing it) the calls write into a private slot while a
 * background thread keeps re-registering.
 *
 * Threading: step and section calls must come from one thread at a time
 * (the training loop); warden_heartbeat and warden_report_exception may be
 * called from any thread.
 * Every function accepts a NULL client as a no-op.
 *
 * Hand-written; keep in sync with client/src/ffi.rs.
 */
#ifndef WARDEN_H
#define WARDEN_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Version of the shared-memory slot layout this library writes (2: the slot
   is a sealed memfd received over the slot socket, no file; 3: each step
   record carries the step's loss and gradient norm). */
#define WARDEN_SLOT_LAYOUT_VERSION 3

/* Fixed ids of the well-known sections. */
#define WARDEN_SECTION_INIT 0
#define WARDEN_SECTION_STEP 1 /* reserved for warden_step_begin/end */
#define WARDEN_SECTION_FORWARD 2
#define WARDEN_SECTION_BACKWARD 3
#define WARDEN_SECTION_OPTIMIZER 4
#define WARDEN_SECTION_CHECKPOINT 5
#define WARDEN_SECTION_DATA 6
#define WARDEN_SECTION_OTHER 7

/* Opaque client handle. */
typedef struct WardenClient warden_client;

/*
 * Registers with the local agent ($WARDEN_SOCKET or the default socket).
 * job_id: NULL means $WARDEN_JOB_ID, else $TORCHELASTIC_RUN_ID, else "default".
 * A negative rank or world size means $RANK / $LOCAL_RANK / $WORLD_SIZE.
 * Waits at most about a second for the agent. Never NULL because the agent
 * is absent; NULL only for invalid arguments (non-UTF-8 job id, rank not
 * below world size, zero world size).
 */
warden_client *warden_connect(const char *job_id, int64_t global_rank,
                              int64_t local_rank, int64_t world_size);

/* 1 when heartbeats currently reach an agent, else 0. */
int32_t warden_is_connected(const warden_client *client);

/* "Still alive". Any thread. */
void warden_heartbeat(const warden_client *client);

/* Starts step `step` (an open step is ended first). */
void warden_step_begin(const warden_client *client, uint64_t step);

/* Ends the open step, closing sections left open inside it. */
void warden_step_end(const warden_client *client, uint64_t step);

/*
 * The id of section `name`, interned on first use (resolve once, outside
 * the hot loop). -1 for a NULL client/name or a non-UTF-8 name. Names past
 * the per-process table (24 user names) map to WARDEN_SECTION_OTHER.
 */
int32_t warden_section_id(const warden_client *client, const char *name);

/* Opens section `id` (negative ids are ignored). */
void warden_section_open(const warden_client *client, int32_t id);

/* Closes section `id` and any section opened inside it. */
void warden_section_close(const warden_client *client, int32_t id);

/* Bits of warden_report_values' `present`. */
#define WARDEN_VALUE_LOSS 1u
#define WARDEN_VALUE_GRAD_NORM 2u

/*
 * Reports the step's loss and gradient norm (those whose bit is set in
 * `present`; NaN and Inf are reported as such) for the agent's silent data
 * corruption check. Into the open step, or between steps the step just
 * ended. Same cost as a section: no syscall, lock or allocation.
 */
void warden_report_values(const warden_client *client, double loss, double grad_norm,
                          uint32_t present);

/*
 * Reports an exception to the agent, which publishes it as a
 * `rank.exception` event and diagnoses the exit that may follow with it
 * (call it from a std::terminate handler, or where an exception is caught
 * at the top of the training loop).
 *
 * type: the exception's type ("std::bad_alloc", "c10::OutOfMemoryError");
 *   required, not empty. message, traceback: may be NULL. Bytes that are not
 *   UTF-8 are replaced. Long tracebacks keep their last 16 KiB.
 * step: the training step; negative: the step last begun on this client.
 * uncaught: non-zero when the process is about to exit because of it; the
 *   client then does not deregister at warden_close, so the agent sees the
 *   exit (code or signal) as the crash it is.
 *
 * Returns 0 when the agent accepted the report, -1 otherwise (NULL client
 * or type, no agent, an error or no answer). Bounded: at most about a
 * second, and at once when no agent is registered with: a dying process
 * never hangs on it. Any thread.
 */
int32_t warden_report_exception(const warden_client *client, const char *type,
                                const char *message, const char *traceback,
                                int64_t step, int32_t uncaught);

/*
 * In-process restarts. The agent may ask the ranks of a job to restart in
 * process (a rank hung alone, `warden restart`): the training loop stops
 * its attempt, restores from its local checkpoint and runs again, keeping
 * its process, CUDA context and imports. A C or C++ loop polls between
 * steps:
 *
 *     uint64_t seq; uint32_t count;
 *     if (warden_restart_pending(c, &seq, &count)) {
 *         restore_from_checkpoint();
 *         warden_ack_restart(c, seq);
 *         ... run again with restart count `count` ...
 *     }
 *
 * warden_restart_pending: 1 when a request waits for an acknowledgement
 * (seq and restart_count written, each when not NULL), else 0 (and for a
 * NULL client). One mutex, no syscall.
 * warden_ack_restart: 0 when seq was the pending request, -1 otherwise.
 * Never waits on the agent. A request not acknowledged within the agent's
 * restart.in_process_timeout (30 s by default) becomes a restart of the
 * job's processes by the launcher.
 */
int32_t warden_restart_pending(const warden_client *client, uint64_t *seq,
                               uint32_t *restart_count);
int32_t warden_ack_restart(const warden_client *client, uint64_t seq);

/* Deregisters and frees the client. NULL is a no-op. */
void warden_close(warden_client *client);

#ifdef __cplusplus
}
#endif

#endif /* WARDEN_H */
