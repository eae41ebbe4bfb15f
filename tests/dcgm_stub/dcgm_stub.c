/*
 * A stand-in libdcgm for warden's tests: the DCGM functions the agent calls,
 * with DCGM 4's C layout (versioned structs, the 1,069,068-byte v5 health
 * response), scripted by the file named in DCGM_STUB_STATE, re-read on
 * every call:
 *
 *   gpus 0 1                 GPUs dcgmGetAllSupportedDevices returns
 *   connect ok|refuse        dcgmConnect_v2 succeeds or fails (CONNECTION_NOT_VALID)
 *   version 5|4|none         the health response version accepted (4: DCGM 3.x)
 *   check ok|block|crash     dcgmHealthCheck answers, never returns, or crashes
 *   incident GROUP ID SYSTEM HEALTH CODE MESSAGE...
 *                            (entity group 3, NVSwitch, is reported to the
 *                            all-NVSwitches group; the others to all-GPUs)
 *
 * Not NVIDIA's code: written from the published headers' layout.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <signal.h>

#define MAX_INCIDENTS_V5 1024
#define MAX_INCIDENTS_V4 64

typedef struct { unsigned int version, persistAfterDisconnect, timeoutMs, addressIsUnixSocket; } connect_params;
typedef struct { char msg[1024]; unsigned int code; } error_detail;
typedef struct { unsigned int entityGroupId, entityId; } entity_pair;
typedef struct { unsigned int system, health; error_detail error; entity_pair entityInfo; } incident_info;
typedef struct { unsigned int version, overallHealth, incidentCount; incident_info incidents[MAX_INCIDENTS_V5]; } response_v5;
typedef struct { unsigned int version, overallHealth, incidentCount; incident_info incidents[MAX_INCIDENTS_V4]; } response_v4;

#define MAKE_VERSION(T, v) ((unsigned int)(sizeof(T) | ((v) << 24)))

static int checks;

static char *script(void) {
    const char *path = getenv("DCGM_STUB_STATE");
    if (!path) return NULL;
    FILE *f = fopen(path, "r");
    if (!f) return NULL;
    static char buf[65536];
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = 0;
    return buf;
}

/* The value after "key " on its own line, or NULL. */
static const char *line_value(const char *text, const char *key, char *out, size_t cap) {
    if (!text) return NULL;
    size_t k = strlen(key);
    const char *p = text;
    while (*p) {
        const char *end = strchr(p, '\n');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        if (len > k && strncmp(p, key, k) == 0 && p[k] == ' ') {
            size_t v = len - k - 1;
            if (v >= cap) v = cap - 1;
            memcpy(out, p + k + 1, v);
            out[v] = 0;
            return out;
        }
        if (!end) break;
        p = end + 1;
    }
    return NULL;
}

int dcgmInit(void) { return 0; }
int dcgmShutdown(void) { return 0; }

int dcgmConnect_v2(const char *addr, connect_params *params, uintptr_t *handle) {
    char v[64];
    if (!addr || !params || !handle) return -1;
    if (params->version != MAKE_VERSION(connect_params, 2)) return -12;
    const char *c = line_value(script(), "connect", v, sizeof v);
    if (c && strcmp(c, "refuse") == 0) return -21;
    *handle = 42;
    return 0;
}

int dcgmStartEmbedded(unsigned int mode, uintptr_t *handle) {
    if (mode != 1 && mode != 2) return -1;
    *handle = 43;
    return 0;
}
int dcgmStopEmbedded(uintptr_t handle) { (void)handle; return 0; }
int dcgmDisconnect(uintptr_t handle) { (void)handle; return 0; }

int dcgmGetAllSupportedDevices(uintptr_t handle, unsigned int *ids, int *count) {
    char v[256];
    (void)handle;
    *count = 0;
    const char *g = line_value(script(), "gpus", v, sizeof v);
    if (!g) return 0;
    char *save = NULL;
    for (char *t = strtok_r(v, " ", &save); t && *count < 32; t = strtok_r(NULL, " ", &save))
        ids[(*count)++] = (unsigned int)atoi(t);
    return 0;
}

int dcgmHealthSet(uintptr_t handle, uintptr_t group, unsigned int systems) {
    (void)handle; (void)group; (void)systems;
    checks = 0;
    return 0;
}

int dcgmHealthCheck(uintptr_t handle, uintptr_t group, void *response) {
    char v[128];
    (void)handle;
    int switches = group == 0x7ffffffe;
    const char *text = script();
    const char *c = line_value(text, "check", v, sizeof v);
    if (c && strcmp(c, "block") == 0) for (;;) pause();
    if (c && strcmp(c, "crash") == 0) raise(SIGSEGV);
    const char *ver = line_value(text, "version", v, sizeof v);
    unsigned int want = (ver && strcmp(ver, "4") == 0) ? MAKE_VERSION(response_v4, 4) : MAKE_VERSION(response_v5, 5);
    if (ver && strcmp(ver, "none") == 0) want = 0;
    unsigned int *hdr = (unsigned int *)response;
    if (hdr[0] != want) return -12;
    unsigned int cap = (want == MAKE_VERSION(response_v4, 4)) ? MAX_INCIDENTS_V4 : MAX_INCIDENTS_V5;
    incident_info *inc = (incident_info *)(hdr + 3);
    hdr[1] = 0;
    hdr[2] = 0;
    /* Like DCGM: the first check after the watches are set reports nothing. */
    if (!switches && checks++ == 0) return 0;
    const char *p = text;
    while (p && *p) {
        const char *end = strchr(p, '\n');
        if (strncmp(p, "incident ", 9) == 0 && hdr[2] < cap) {
            incident_info *i = &inc[hdr[2]];
            unsigned int group, id, health, code;
            long long system;
            int used = 0;
            if (sscanf(p + 9, "%u %u %lli %u %u %n", &group, &id, &system, &health, &code, &used) >= 5
                && (group == 3) == switches) {
                memset(i, 0, sizeof *i);
                i->system = (unsigned int)system;
                i->health = health;
                i->error.code = code;
                i->entityInfo.entityGroupId = group;
                i->entityInfo.entityId = id;
                size_t len = end ? (size_t)(end - (p + 9 + used)) : strlen(p + 9 + used);
                if (len > sizeof(i->error.msg) - 1) len = sizeof(i->error.msg) - 1;
                memcpy(i->error.msg, p + 9 + used, len);
                if (health > hdr[1]) hdr[1] = health;
                hdr[2]++;
            }
        }
        p = end ? end + 1 : NULL;
    }
    return 0;
}

const char *errorString(int result) {
    switch (result) {
    case -12: return "The requested version is not supported";
    case -21: return "The connection to the host engine is not valid any longer";
    default: return "Unknown error";
    }
}
