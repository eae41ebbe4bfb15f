/* Drives the C ABI with no agent running: every call succeeds, nothing
 * blocks, NULL handles are no-ops. Exits 0 on success. */
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "warden.h"

#define CHECK(cond)                                                         \
    do {                                                                    \
        if (!(cond)) {                                                      \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, \
                    #cond);                                                 \
            return 1;                                                       \
        }                                                                   \
    } while (0)

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(void) {
    /* The slot-free path: a NULL client is a no-op everywhere. */
    warden_heartbeat(NULL);
    warden_step_begin(NULL, 1);
    warden_section_open(NULL, WARDEN_SECTION_FORWARD);
    warden_section_close(NULL, WARDEN_SECTION_FORWARD);
    warden_step_end(NULL, 1);
    CHECK(warden_section_id(NULL, "forward") == -1);
    CHECK(warden_is_connected(NULL) == 0);
    CHECK(warden_report_exception(NULL, "RuntimeError", "m", "tb", 1, 1) == -1);
    warden_close(NULL);

    /* Invalid arguments are the only way to get NULL. */
    CHECK(warden_connect("job", 4, 0, 4) == NULL);
    CHECK(warden_connect("job", 0, 0, 0) == NULL);
    CHECK(warden_connect("\xff\xfe", 0, 0, 1) == NULL);

    /* No agent: a client all the same, quickly. */
    double t0 = now_s();
    warden_client *c = warden_connect("c-test", 0, 0, 1);
    CHECK(c != NULL);
    CHECK(now_s() - t0 < 2.0);
    CHECK(warden_is_connected(c) == 0);

    CHECK(warden_section_id(c, "forward") == WARDEN_SECTION_FORWARD);
    CHECK(warden_section_id(c, "data") == WARDEN_SECTION_DATA);
    int32_t mine = warden_section_id(c, "my-phase");
    CHECK(mine >= 8 && mine < 32);
    CHECK(warden_section_id(c, "my-phase") == mine);
    CHECK(warden_section_id(c, NULL) == -1);

    for (uint64_t step = 0; step < 1000; step++) {
        warden_step_begin(c, step);
        warden_section_open(c, WARDEN_SECTION_FORWARD);
        warden_section_open(c, mine);
        warden_heartbeat(c);
        warden_section_close(c, mine);
        warden_section_close(c, WARDEN_SECTION_FORWARD);
        warden_section_open(c, WARDEN_SECTION_BACKWARD);
        warden_section_close(c, WARDEN_SECTION_BACKWARD);
        warden_report_values(c, 2.5, 1.0 / 0.0, WARDEN_VALUE_LOSS | WARDEN_VALUE_GRAD_NORM);
        warden_step_end(c, step);
    }
    warden_report_values(c, 1.0, 0.0, WARDEN_VALUE_LOSS);
    warden_report_values(NULL, 1.0, 1.0, WARDEN_VALUE_LOSS);
    /* No agent: an exception report fails at once, whatever its arguments. */
    t0 = now_s();
    CHECK(warden_report_exception(c, "std::bad_alloc", "out of memory", NULL, -1, 0) == -1);
    CHECK(warden_report_exception(c, NULL, "m", "tb", 3, 0) == -1);
    CHECK(warden_report_exception(c, "", NULL, NULL, 3, 0) == -1);
    CHECK(warden_report_exception(c, "\xff\xfe", "\xff", "\xfe", 3, 0) == -1);
    CHECK(now_s() - t0 < 0.5);

    /* No agent: no restart request, and nothing to acknowledge. */
    uint64_t seq = 99;
    uint32_t count = 99;
    CHECK(warden_restart_pending(c, &seq, &count) == 0);
    CHECK(seq == 99 && count == 99);
    CHECK(warden_restart_pending(c, NULL, NULL) == 0);
    CHECK(warden_ack_restart(c, 1) == -1);
    CHECK(warden_restart_pending(NULL, &seq, &count) == 0);
    CHECK(warden_ack_restart(NULL, 1) == -1);

    /* Misuse is tolerated. */
    warden_section_close(c, 12345);
    warden_section_open(c, -3);
    warden_step_end(c, 7);

    /* Hot-path cost with no agent, for the record. */
    const int n = 10000000;
    t0 = now_s();
    for (int i = 0; i < n; i++) warden_heartbeat(c);
    double hb = (now_s() - t0) / n * 1e9;
    t0 = now_s();
    for (int i = 0; i < n; i++) {
        warden_section_open(c, WARDEN_SECTION_FORWARD);
        warden_section_close(c, WARDEN_SECTION_FORWARD);
    }
    double sec = (now_s() - t0) / n * 1e9;
    printf("heartbeat %.1f ns, section open+close %.1f ns\n", hb, sec);

    t0 = now_s();
    warden_close(c);
    CHECK(now_s() - t0 < 2.0);
    puts("ok");
    return 0;
}
