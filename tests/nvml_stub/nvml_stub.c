/* A stand-in libnvidia-ml for tests: exports the NVML C functions wardend
 * calls, with NVML's real signatures, its state scripted by the test through
 * the file named by $NVML_STUB_STATE (key=value lines, re-read on each call):
 *
 *   count=2                 GPUs NVML reports
 *   init_error=9            nvmlInit_v2 fails with this code (9: driver not loaded)
 *   hang=1                  nvmlDeviceGetTotalEccErrors blocks while set
 *   gpuN.lost=1             every call on GPU N returns NVML_ERROR_GPU_IS_LOST
 *   gpuN.ecc_unc  gpuN.ecc_corr  gpuN.ecc_unc_agg   volatile/aggregate ECC
 *   gpuN.retired  gpuN.retired_pending
 *   gpuN.remap_corr  gpuN.remap_unc  gpuN.remap_pending  gpuN.remap_failure
 *   gpuN.pcie_replay  gpuN.pcie_gen  gpuN.pcie_width  gpuN.throttle
 *   gpuN.temp  gpuN.power_mw  gpuN.nvlinks  gpuN.nvlinkL.down  gpuN.nvlinkL.replay
 *   gpuN.recovery_action=A  field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (230);
 *                           unset: the field is NOT_SUPPORTED (a pre-r570 driver)
 *   gpuN.register_error=E   nvmlDeviceRegisterEvents on GPU N fails with E (3: not supported)
 *   gpuN.pids=P1,P2,...     processes with a compute context on GPU N (at most 64)
 *   xid.S=N,CODE            XID CODE on GPU N, delivered once, in order of S, to a
 *                           set GPU N is registered on (else skipped)
 *
 * Event sets behave as NVML's: each holds the GPUs registered on it, a freed
 * set delivers nothing, and a failed registration leaves the set as it was.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int nvmlReturn_t;
typedef struct stub_device { int index; } *nvmlDevice_t;
typedef struct stub_set { int freed; unsigned long long registered; } *nvmlEventSet_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

enum { OK = 0, INVALID_ARG = 2, NOT_SUPPORTED = 3, INSUFFICIENT_SIZE = 7,
       TIMEOUT = 10, GPU_IS_LOST = 15 };
#define MAX_GPUS 64
#define XID_EVENT 0x8ULL /* nvmlEventTypeXidCriticalError */

static struct stub_device devices[MAX_GPUS];
static long delivered_xid = -1;

/* The state file's text. Read on every call, so a test's rewrite takes
 * effect at once; with NVML_STUB_CACHE set (benchmarks, whose state never
 * changes) it is read once, so a measurement shows the agent's cost rather
 * than the stub's file reads. */
static char cache[65536];
static int cached = 0;

static const char *state_text(void) {
    if (cached) return cache;
    const char *path = getenv("NVML_STUB_STATE");
    if (!path) return NULL;
    FILE *f = fopen(path, "r");
    if (!f) return NULL;
    size_t n = fread(cache, 1, sizeof cache - 1, f);
    fclose(f);
    cache[n] = 0;
    if (getenv("NVML_STUB_CACHE")) cached = 1;
    return cache;
}

/* The value of `key` in the state file, or `dflt`. */
static long get(const char *key, long dflt) {
    const char *text = state_text();
    if (!text) return dflt;
    size_t n = strlen(key);
    long v = dflt;
    for (const char *line = text; *line;) {
        if (strncmp(line, key, n) == 0 && line[n] == '=') v = strtol(line + n + 1, NULL, 10);
        const char *next = strchr(line, '\n');
        if (!next) break;
        line = next + 1;
    }
    return v;
}

static long gpu_get(int i, const char *what, long dflt) {
    char key[128];
    snprintf(key, sizeof key, "gpu%d.%s", i, what);
    return get(key, dflt);
}

/* Checks a device handle; returns the GPU's error if it is lost. */
static nvmlReturn_t check(nvmlDevice_t d) {
    if (!d || d->index < 0 || d->index >= MAX_GPUS) return INVALID_ARG;
    return gpu_get(d->index, "lost", 0) ? GPU_IS_LOST : OK;
}
#define CHECK(d) do { nvmlReturn_t r_ = check(d); if (r_) return r_; } while (0)

nvmlReturn_t nvmlInit_v2(void) { return (nvmlReturn_t)get("init_error", 0); }
nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { (void)flags; return nvmlInit_v2(); }
nvmlReturn_t nvmlShutdown(void) { return OK; }
const char *nvmlErrorString(nvmlReturn_t r) { (void)r; return "stub error"; }

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    *count = (unsigned int)get("count", 0);
    return OK;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (index >= MAX_GPUS || index >= (unsigned int)get("count", 0)) return INVALID_ARG;
    devices[index].index = (int)index;
    *device = &devices[index];
    return OK;
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t d, unsigned int *index) {
    if (!d) return INVALID_ARG;
    *index = (unsigned int)d->index;
    return OK;
}

/* The raw text of `key`'s value (up to the end of its line), or NULL. */
static const char *raw(const char *key) {
    const char *text = state_text();
    if (!text) return NULL;
    size_t n = strlen(key);
    const char *found = NULL;
    for (const char *line = text; *line;) {
        if (strncmp(line, key, n) == 0 && line[n] == '=') found = line + n + 1;
        const char *next = strchr(line, '\n');
        if (!next) break;
        line = next + 1;
    }
    return found;
}

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

/* As NVML: with too small a buffer (or none), the count and INSUFFICIENT_SIZE. */
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *count,
                                                     nvmlProcessInfo_t *infos) {
    CHECK(d);
    if (!count) return INVALID_ARG;
    char key[64];
    snprintf(key, sizeof key, "gpu%d.pids", d->index);
    unsigned int pids[64];
    unsigned int n = 0;
    const char *v = raw(key);
    while (v && *v && *v != '\n' && n < 64) {
        char *end;
        unsigned long p = strtoul(v, &end, 10);
        if (end == v) break;
        pids[n++] = (unsigned int)p;
        v = (*end == ',') ? end + 1 : end;
    }
    if (!infos || *count < n) {
        *count = n;
        return n ? INSUFFICIENT_SIZE : OK;
    }
    for (unsigned int i = 0; i < n; i++) {
        infos[i].pid = pids[i];
        infos[i].usedGpuMemory = 1ULL << 30;
        infos[i].gpuInstanceId = 0xFFFFFFFFu;
        infos[i].computeInstanceId = 0xFFFFFFFFu;
    }
    *count = n;
    return OK;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int length) {
    CHECK(d);
    snprintf(uuid, length, "GPU-00000000-0000-0000-0000-%012d", d->index);
    return OK;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int length) {
    CHECK(d);
    snprintf(name, length, "Stub GPU");
    return OK;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *pci) {
    if (!d) return INVALID_ARG;
    memset(pci, 0, sizeof *pci);
    pci->bus = (unsigned int)(0x10 + d->index);
    snprintf(pci->busId, sizeof pci->busId, "00000000:%02X:00.0", pci->bus);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "0000:%02X:00.0", pci->bus);
    return check(d);
}

/* errorType: 0 corrected, 1 uncorrected; counterType: 0 volatile, 1 aggregate. */
nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t d, int errorType, int counterType,
                                         unsigned long long *count) {
    while (get("hang", 0)) usleep(50 * 1000);
    CHECK(d);
    const char *what = errorType ? (counterType ? "ecc_unc_agg" : "ecc_unc")
                                 : (counterType ? "ecc_corr_agg" : "ecc_corr");
    *count = (unsigned long long)gpu_get(d->index, what, 0);
    return OK;
}

/* cause 1 (double-bit) carries every scripted retired page. */
nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t d, int cause, unsigned int *count,
                                       unsigned long long *addresses) {
    CHECK(d);
    unsigned int n = cause == 1 ? (unsigned int)gpu_get(d->index, "retired", 0) : 0;
    unsigned int room = *count;
    *count = n;
    if (room < n) return INSUFFICIENT_SIZE;
    for (unsigned int i = 0; i < n; i++) addresses[i] = 0x1000ULL * i;
    return OK;
}

nvmlReturn_t nvmlDeviceGetRetiredPages_v2(nvmlDevice_t d, int cause, unsigned int *count,
                                          unsigned long long *addresses,
                                          unsigned long long *timestamps) {
    nvmlReturn_t r = nvmlDeviceGetRetiredPages(d, cause, count, addresses);
    if (r == OK && timestamps)
        for (unsigned int i = 0; i < *count; i++) timestamps[i] = 0;
    return r;
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t d, int *pending) {
    CHECK(d);
    *pending = (int)gpu_get(d->index, "retired_pending", 0);
    return OK;
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t d, unsigned int *corr, unsigned int *unc,
                                       unsigned int *pending, unsigned int *failure) {
    CHECK(d);
    *corr = (unsigned int)gpu_get(d->index, "remap_corr", 0);
    *unc = (unsigned int)gpu_get(d->index, "remap_unc", 0);
    *pending = (unsigned int)gpu_get(d->index, "remap_pending", 0);
    *failure = (unsigned int)gpu_get(d->index, "remap_failure", 0);
    return OK;
}

nvmlReturn_t nvmlDeviceGetPcieReplayCounter(nvmlDevice_t d, unsigned int *v) {
    CHECK(d);
    *v = (unsigned int)gpu_get(d->index, "pcie_replay", 0);
    return OK;
}

#define PCIE(fn, key, dflt) \
    nvmlReturn_t fn(nvmlDevice_t d, unsigned int *v) { \
        CHECK(d); *v = (unsigned int)gpu_get(d->index, key, dflt); return OK; }
PCIE(nvmlDeviceGetCurrPcieLinkGeneration, "pcie_gen", 5)
PCIE(nvmlDeviceGetMaxPcieLinkGeneration, "pcie_gen_max", 5)
PCIE(nvmlDeviceGetCurrPcieLinkWidth, "pcie_width", 16)
PCIE(nvmlDeviceGetMaxPcieLinkWidth, "pcie_width_max", 16)

nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t d,
                                                       unsigned long long *reasons) {
    CHECK(d);
    *reasons = (unsigned long long)gpu_get(d->index, "throttle", 0);
    return OK;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t d, int sensor, unsigned int *temp) {
    (void)sensor;
    CHECK(d);
    *temp = (unsigned int)gpu_get(d->index, "temp", 40);
    return OK;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t d, unsigned int *mw) {
    CHECK(d);
    *mw = (unsigned int)gpu_get(d->index, "power_mw", 300000);
    return OK;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t d, unsigned int link, int *active) {
    CHECK(d);
    if (link >= (unsigned int)gpu_get(d->index, "nvlinks", 0)) return INVALID_ARG;
    char key[64];
    snprintf(key, sizeof key, "nvlink%u.down", link);
    *active = gpu_get(d->index, key, 0) ? 0 : 1;
    return OK;
}

/* counter: 0 replay, 1 recovery, 2 CRC flit, 3 CRC data. */
nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(nvmlDevice_t d, unsigned int link, int counter,
                                             unsigned long long *value) {
    static const char *names[] = {"replay", "recovery", "crc_flit", "crc_data"};
    CHECK(d);
    if (counter < 0 || counter > 3) return INVALID_ARG;
    char key[64];
    snprintf(key, sizeof key, "nvlink%u.%s", link, names[counter]);
    *value = (unsigned long long)gpu_get(d->index, key, 0);
    return OK;
}

typedef union {
    double dVal; int siVal; unsigned int uiVal; unsigned long ulVal;
    unsigned long long ullVal; long long sllVal; unsigned short usVal;
} nvmlValue_t;

typedef struct {
    unsigned int fieldId;
    unsigned int scopeId;
    long long timestamp;
    long long latencyUsec;
    int valueType;
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

#define FI_RECOVERY_ACTION 230 /* NVML_FI_DEV_GET_GPU_RECOVERY_ACTION */
#define VALUE_TYPE_UNSIGNED_INT 1

/* Answers the recovery action where scripted; every other field, and an
 * unscripted recovery action, is NOT_SUPPORTED. */
nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t d, int count, nvmlFieldValue_t *values) {
    CHECK(d);
    if (count < 0 || (count > 0 && !values)) return INVALID_ARG;
    for (int i = 0; i < count; i++) {
        nvmlFieldValue_t *v = &values[i];
        long a = v->fieldId == FI_RECOVERY_ACTION ? gpu_get(d->index, "recovery_action", -1) : -1;
        v->timestamp = 0;
        v->latencyUsec = 0;
        if (a < 0) {
            v->nvmlReturn = NOT_SUPPORTED;
            continue;
        }
        v->nvmlReturn = OK;
        v->valueType = VALUE_TYPE_UNSIGNED_INT;
        v->value.uiVal = (unsigned int)a;
    }
    return OK;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    *set = calloc(1, sizeof **set);
    return *set ? OK : INVALID_ARG;
}

/* Marks the set freed (kept allocated, so a late wait reads no freed memory). */
nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    if (!set) return INVALID_ARG;
    set->freed = 1;
    return OK;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t d, unsigned long long types,
                                      nvmlEventSet_t set) {
    CHECK(d);
    if (!set || set->freed || !(types & XID_EVENT)) return INVALID_ARG;
    long err = gpu_get(d->index, "register_error", 0);
    if (err) return (nvmlReturn_t)err;
    set->registered |= 1ULL << d->index;
    return OK;
}

/* Delivers the next scripted XID (xid.S=N,CODE with S above the last one
 * delivered), else waits out the timeout in short naps. */
nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int ms) {
    if (!set || set->freed) return INVALID_ARG;
    for (unsigned int waited = 0;; waited += 20) {
        const char *path = getenv("NVML_STUB_STATE");
        FILE *f = path ? fopen(path, "r") : NULL;
        long best = -1, gpu = 0, code = 0;
        char line[256];
        while (f && fgets(line, sizeof line, f)) {
            long s, g, c;
            if (sscanf(line, "xid.%ld=%ld,%ld", &s, &g, &c) == 3 && s > delivered_xid &&
                g >= 0 && g < MAX_GPUS && (set->registered & (1ULL << g)) &&
                (best < 0 || s < best)) {
                best = s; gpu = g; code = c;
            }
        }
        if (f) fclose(f);
        if (best >= 0 && gpu >= 0 && gpu < MAX_GPUS) {
            delivered_xid = best;
            devices[gpu].index = (int)gpu;
            memset(data, 0, sizeof *data);
            data->device = &devices[gpu];
            data->eventType = XID_EVENT;
            data->eventData = (unsigned long long)code;
            return OK;
        }
        if (waited >= ms) return TIMEOUT;
        usleep(20 * 1000);
    }
}
