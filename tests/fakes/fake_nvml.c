/*
 * A fake libnvidia-ml.so.1 for tests without a GPU.
 *
 * Compiled against the real nvml.h so every signature and struct matches what pynvml expects.
 * Its GPUs, live readings, per-process samples and failure rules come from a text file named
 * by FAKE_NVML_CONFIG, re-read whenever the file changes (tests replace it atomically with
 * rename). XID events come from the file named by FAKE_NVML_EVENTS: lines "<uuid> <xid>"
 * appended there are delivered by nvmlEventSetWait_v2 to the event sets registered for them.
 *
 * Config lines (blank lines and '#' comments are ignored):
 *   driver <version>
 *   gpu <uuid> [key=value ...] [name=<rest of the line>]
 *       keys: memory used minor pci cc (M.m) mig (0|1) numa (int|none) util memutil temp
 *             power (milliwatts) procutil (1|0: per-process utilization supported)
 *             events (hex mask of supported event types)
 *   procutil <uuid> <pid> <timestamp_us> <sm%> [mem%]
 *   proc <uuid> <pid> <used_bytes>
 *   fail <call|*> <uuid|*> <nvml error code>
 * A fail rule names an exported symbol, with or without its _vN suffix (nvmlInit covers
 * nvmlInit_v2 and nvmlInitWithFlags);
 * "*" as call matches every call made on that device, "*" as uuid matches every device.
 *
 * Not in the real library: fake_nvml_call_count(name) says how many times a device call was
 * made since the library was loaded (failed ones included), so that tests can count what a
 * caller costs the driver.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "nvml.h"

#define MAX_GPUS 64
#define MAX_SAMPLES 4096
#define MAX_PROCS 1024
#define MAX_RULES 256
#define EVENT_POLL_NS (2 * 1000 * 1000) /* how often a waiting event set looks at the file */

struct nvmlDevice_st {
    unsigned int index;
};

struct fake_gpu {
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    char pci[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
    unsigned long long memory, used, events;
    unsigned int minor, util, memutil, temp, power_mw;
    int cc_major, cc_minor, mig, numa, procutil_supported;
};

struct fake_sample {
    unsigned int gpu, pid, sm, mem;
    unsigned long long ts;
};

struct fake_proc {
    unsigned int gpu, pid;
    unsigned long long used;
};

struct fake_rule {
    char call[96];
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    nvmlReturn_t code;
};

struct fake_config {
    char driver[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
    unsigned int ngpus, nsamples, nprocs, nrules;
    struct fake_gpu gpus[MAX_GPUS];
    struct fake_sample samples[MAX_SAMPLES];
    struct fake_proc procs[MAX_PROCS];
    struct fake_rule rules[MAX_RULES];
};

struct nvmlEventSet_st {
    unsigned long long masks[MAX_GPUS]; /* registered event types per device index */
    long offset;                        /* bytes of the events file already consumed */
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct nvmlDevice_st devices[MAX_GPUS];
static struct fake_config config;
static int init_count;
static struct stat config_stat;
static char config_path[4096];
static char events_path[4096];

/* ---- config parsing ---------------------------------------------------------------------- */

static int find_gpu(const struct fake_config *c, const char *uuid)
{
    for (unsigned int i = 0; i < c->ngpus; i++)
        if (strcmp(c->gpus[i].uuid, uuid) == 0)
            return (int)i;
    return -1;
}

static int parse_gpu(struct fake_config *c, char *rest, int lineno)
{
    if (c->ngpus >= MAX_GPUS) {
        fprintf(stderr, "fake-nvml: line %d: more than %d GPUs\n", lineno, MAX_GPUS);
        return -1;
    }
    struct fake_gpu *g = &c->gpus[c->ngpus];
    memset(g, 0, sizeof(*g));
    g->memory = 16ULL << 30;
    g->cc_major = 8;
    g->numa = -1;
    g->temp = 40;
    g->power_mw = 50000;
    g->procutil_supported = 1;
    g->events = nvmlEventTypeXidCriticalError | nvmlEventTypeSingleBitEccError |
                nvmlEventTypeDoubleBitEccError;
    snprintf(g->name, sizeof(g->name), "NVIDIA Fake GPU");
    snprintf(g->pci, sizeof(g->pci), "00000000:%02X:00.0", c->ngpus + 1);
    g->minor = c->ngpus;

    char *save = NULL;
    char *tok = strtok_r(rest, " \t", &save);
    if (!tok) {
        fprintf(stderr, "fake-nvml: line %d: gpu needs a uuid\n", lineno);
        return -1;
    }
    snprintf(g->uuid, sizeof(g->uuid), "%s", tok);
    while ((tok = strtok_r(NULL, " \t", &save))) {
        char *eq = strchr(tok, '=');
        if (!eq) {
            fprintf(stderr, "fake-nvml: line %d: expected key=value, got '%s'\n", lineno, tok);
            return -1;
        }
        *eq = '\0';
        const char *k = tok, *v = eq + 1;
        if (strcmp(k, "name") == 0) {
            /* the name runs to the end of the line: glue the remaining tokens back on */
            char *tail = strtok_r(NULL, "", &save);
            snprintf(g->name, sizeof(g->name), "%s%s%s", v, tail ? " " : "", tail ? tail : "");
            break;
        } else if (strcmp(k, "memory") == 0) g->memory = strtoull(v, NULL, 10);
        else if (strcmp(k, "used") == 0) g->used = strtoull(v, NULL, 10);
        else if (strcmp(k, "minor") == 0) g->minor = (unsigned int)strtoul(v, NULL, 10);
        else if (strcmp(k, "pci") == 0) snprintf(g->pci, sizeof(g->pci), "%s", v);
        else if (strcmp(k, "cc") == 0) {
            if (sscanf(v, "%d.%d", &g->cc_major, &g->cc_minor) != 2) {
                fprintf(stderr, "fake-nvml: line %d: cc must be M.m, got '%s'\n", lineno, v);
                return -1;
            }
        } else if (strcmp(k, "mig") == 0) g->mig = atoi(v);
        else if (strcmp(k, "numa") == 0) g->numa = strcmp(v, "none") == 0 ? -2 : atoi(v);
        else if (strcmp(k, "util") == 0) g->util = (unsigned int)strtoul(v, NULL, 10);
        else if (strcmp(k, "memutil") == 0) g->memutil = (unsigned int)strtoul(v, NULL, 10);
        else if (strcmp(k, "temp") == 0) g->temp = (unsigned int)strtoul(v, NULL, 10);
        else if (strcmp(k, "power") == 0) g->power_mw = (unsigned int)strtoul(v, NULL, 10);
        else if (strcmp(k, "procutil") == 0) g->procutil_supported = atoi(v);
        else if (strcmp(k, "events") == 0) g->events = strtoull(v, NULL, 16);
        else {
            fprintf(stderr, "fake-nvml: line %d: unknown gpu key '%s'\n", lineno, k);
            return -1;
        }
    }
    c->ngpus++;
    return 0;
}

static int parse_line(struct fake_config *c, char *line, int lineno)
{
    char *p = line;
    while (*p == ' ' || *p == '\t')
        p++;
    if (*p == '\0' || *p == '#')
        return 0;
    char kind[16];
    int used = 0;
    if (sscanf(p, "%15s%n", kind, &used) != 1)
        return 0;
    char *rest = p + used;

    if (strcmp(kind, "driver") == 0) {
        if (sscanf(rest, "%79s", c->driver) != 1)
            goto bad;
        return 0;
    }
    if (strcmp(kind, "gpu") == 0)
        return parse_gpu(c, rest, lineno);
    if (strcmp(kind, "procutil") == 0) {
        char uuid[96];
        struct fake_sample s = {0};
        int n = sscanf(rest, "%95s %u %llu %u %u", uuid, &s.pid, &s.ts, &s.sm, &s.mem);
        int gi = find_gpu(c, uuid);
        if (n < 4 || gi < 0 || c->nsamples >= MAX_SAMPLES)
            goto bad;
        s.gpu = (unsigned int)gi;
        c->samples[c->nsamples++] = s;
        return 0;
    }
    if (strcmp(kind, "proc") == 0) {
        char uuid[96];
        struct fake_proc pr = {0};
        int gi;
        if (sscanf(rest, "%95s %u %llu", uuid, &pr.pid, &pr.used) != 3 ||
            (gi = find_gpu(c, uuid)) < 0 || c->nprocs >= MAX_PROCS)
            goto bad;
        pr.gpu = (unsigned int)gi;
        c->procs[c->nprocs++] = pr;
        return 0;
    }
    if (strcmp(kind, "fail") == 0) {
        struct fake_rule r;
        int code;
        if (c->nrules >= MAX_RULES || sscanf(rest, "%95s %95s %d", r.call, r.uuid, &code) != 3)
            goto bad;
        r.code = (nvmlReturn_t)code;
        c->rules[c->nrules++] = r;
        return 0;
    }
bad:
    fprintf(stderr, "fake-nvml: line %d: cannot parse '%s'\n", lineno, line);
    return -1;
}

static int load_config(const char *path, struct fake_config *out)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "fake-nvml: cannot open %s: %s\n", path, strerror(errno));
        return -1;
    }
    memset(out, 0, sizeof(*out));
    snprintf(out->driver, sizeof(out->driver), "550.54.15");
    char line[1024];
    int lineno = 0, rc = 0;
    while (fgets(line, sizeof(line), f)) {
        lineno++;
        line[strcspn(line, "\r\n")] = '\0';
        if (parse_line(out, line, lineno) != 0)
            rc = -1;
    }
    fclose(f);
    return rc;
}

static int same_file_state(const struct stat *a, const struct stat *b)
{
    return a->st_ino == b->st_ino && a->st_size == b->st_size &&
           a->st_mtim.tv_sec == b->st_mtim.tv_sec && a->st_mtim.tv_nsec == b->st_mtim.tv_nsec;
}

/* Re-read the config when the file changed; a broken new file keeps the last good one. */
static void refresh_locked(void)
{
    struct stat st;
    if (config_path[0] == '\0' || stat(config_path, &st) != 0 || same_file_state(&st, &config_stat))
        return;
    static struct fake_config fresh;
    if (load_config(config_path, &fresh) == 0) {
        config = fresh;
        config_stat = st;
    } else {
        fprintf(stderr, "fake-nvml: keeping the previous config\n");
        config_stat = st; /* do not re-parse the same broken file on every call */
    }
}

/* ---- failure rules ----------------------------------------------------------------------- */

/* "nvmlDeviceGetPciInfo" names nvmlDeviceGetPciInfo_v3 too: rules may omit the version suffix */
static int call_matches(const char *rule, const char *call)
{
    size_t n = strlen(rule);
    if (strncmp(rule, call, n) != 0)
        return 0;
    const char *rest = call + n;
    if (*rest == '\0')
        return 1;
    if (rest[0] != '_' || rest[1] != 'v' || rest[2] == '\0')
        return 0;
    for (rest += 2; *rest; rest++)
        if (*rest < '0' || *rest > '9')
            return 0;
    return 1;
}

static nvmlReturn_t rule_for(const char *call, int gpu)
{
    for (unsigned int i = 0; i < config.nrules; i++) {
        const struct fake_rule *r = &config.rules[i];
        int call_ok = call_matches(r->call, call) || (strcmp(r->call, "*") == 0 && gpu >= 0);
        int uuid_ok = strcmp(r->uuid, "*") == 0 ||
                      (gpu >= 0 && strcmp(r->uuid, config.gpus[gpu].uuid) == 0);
        if (call_ok && uuid_ok)
            return r->code;
    }
    return NVML_SUCCESS;
}

#define MAX_COUNTED 64
static struct {
    const char *call; /* the entry point's name, a string literal */
    unsigned long count;
} counted[MAX_COUNTED];

static void count_call_locked(const char *call)
{
    for (unsigned int i = 0; i < MAX_COUNTED; i++) {
        if (counted[i].call == NULL)
            counted[i].call = call;
        if (strcmp(counted[i].call, call) == 0) {
            counted[i].count++;
            return;
        }
    }
}

unsigned long fake_nvml_call_count(const char *call)
{
    unsigned long count = 0;
    pthread_mutex_lock(&lock);
    for (unsigned int i = 0; i < MAX_COUNTED && counted[i].call != NULL; i++)
        if (call != NULL && strcmp(counted[i].call, call) == 0)
            count = counted[i].count;
    pthread_mutex_unlock(&lock);
    return count;
}

/* Common entry for device calls: initialised, fresh config, valid handle, no failure rule. */
static nvmlReturn_t enter_device(const char *call, nvmlDevice_t device, int *gpu)
{
    pthread_mutex_lock(&lock);
    count_call_locked(call);
    if (init_count == 0) {
        pthread_mutex_unlock(&lock);
        return NVML_ERROR_UNINITIALIZED;
    }
    refresh_locked();
    if (device < devices || device >= devices + MAX_GPUS || device->index >= config.ngpus) {
        pthread_mutex_unlock(&lock);
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *gpu = (int)device->index;
    nvmlReturn_t rc = rule_for(call, *gpu);
    if (rc != NVML_SUCCESS)
        pthread_mutex_unlock(&lock);
    return rc;
}

static nvmlReturn_t enter_system(const char *call)
{
    pthread_mutex_lock(&lock);
    if (init_count == 0) {
        pthread_mutex_unlock(&lock);
        return NVML_ERROR_UNINITIALIZED;
    }
    refresh_locked();
    nvmlReturn_t rc = rule_for(call, -1);
    if (rc != NVML_SUCCESS)
        pthread_mutex_unlock(&lock);
    return rc;
}

#define LEAVE(rc)                                                                                  \
    do {                                                                                           \
        pthread_mutex_unlock(&lock);                                                               \
        return (rc);                                                                               \
    } while (0)

/* ---- init / shutdown / errors ------------------------------------------------------------ */

static nvmlReturn_t do_init(void)
{
    pthread_mutex_lock(&lock);
    if (init_count == 0) {
        const char *cp = getenv("FAKE_NVML_CONFIG");
        const char *ep = getenv("FAKE_NVML_EVENTS");
        if (!cp || !*cp) {
            fprintf(stderr, "fake-nvml: FAKE_NVML_CONFIG is not set\n");
            LEAVE(NVML_ERROR_DRIVER_NOT_LOADED);
        }
        snprintf(config_path, sizeof(config_path), "%s", cp);
        snprintf(events_path, sizeof(events_path), "%s", ep ? ep : "");
        struct stat st;
        if (stat(config_path, &st) != 0)
            LEAVE(NVML_ERROR_DRIVER_NOT_LOADED);
        if (load_config(config_path, &config) != 0)
            LEAVE(NVML_ERROR_UNKNOWN);
        config_stat = st;
        for (unsigned int i = 0; i < MAX_GPUS; i++)
            devices[i].index = i;
    } else {
        refresh_locked();
    }
    nvmlReturn_t rc = rule_for("nvmlInit", -1);
    if (rc != NVML_SUCCESS)
        LEAVE(rc);
    init_count++;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlInit_v2(void) { return do_init(); }

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    return do_init();
}

nvmlReturn_t nvmlShutdown(void)
{
    pthread_mutex_lock(&lock);
    if (init_count == 0)
        LEAVE(NVML_ERROR_UNINITIALIZED);
    nvmlReturn_t rc = rule_for("nvmlShutdown", -1);
    if (rc != NVML_SUCCESS)
        LEAVE(rc);
    init_count--;
    if (init_count == 0)
        memset(&config_stat, 0, sizeof(config_stat));
    LEAVE(NVML_SUCCESS);
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_NO_DATA: return "No data";
    default: return "Unknown Error";
    }
}

/* ---- system and handles ------------------------------------------------------------------ */

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    nvmlReturn_t rc = enter_system("nvmlSystemGetDriverVersion");
    if (rc != NVML_SUCCESS)
        return rc;
    if (!version)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (strlen(config.driver) + 1 > length)
        LEAVE(NVML_ERROR_INSUFFICIENT_SIZE);
    snprintf(version, length, "%s", config.driver);
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v)
{
    nvmlReturn_t rc = enter_system("nvmlSystemGetCudaDriverVersion");
    if (rc != NVML_SUCCESS)
        return rc;
    if (!v)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *v = 12040;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) { return nvmlSystemGetCudaDriverVersion(v); }

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    nvmlReturn_t rc = enter_system("nvmlDeviceGetCount_v2");
    if (rc != NVML_SUCCESS)
        return rc;
    if (!count)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *count = config.ngpus;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    nvmlReturn_t rc = enter_system("nvmlDeviceGetHandleByIndex_v2");
    if (rc != NVML_SUCCESS)
        return rc;
    if (!device || index >= config.ngpus)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    rc = rule_for("nvmlDeviceGetHandleByIndex_v2", (int)index);
    if (rc == NVML_SUCCESS)
        *device = &devices[index];
    LEAVE(rc);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    nvmlReturn_t rc = enter_system("nvmlDeviceGetHandleByUUID");
    if (rc != NVML_SUCCESS)
        return rc;
    if (!uuid || !device)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    int gi = find_gpu(&config, uuid);
    if (gi < 0)
        LEAVE(NVML_ERROR_NOT_FOUND);
    rc = rule_for("nvmlDeviceGetHandleByUUID", gi);
    if (rc == NVML_SUCCESS)
        *device = &devices[gi];
    LEAVE(rc);
}

static nvmlReturn_t copy_string(const char *src, char *dst, unsigned int length)
{
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    snprintf(dst, length, "%s", src);
    return NVML_SUCCESS;
}

#define DEVICE_CALL(name)                                                                          \
    int gpu;                                                                                       \
    nvmlReturn_t rc_ = enter_device(name, device, &gpu);                                           \
    if (rc_ != NVML_SUCCESS)                                                                       \
        return rc_;                                                                                \
    const struct fake_gpu *g = &config.gpus[gpu];                                                  \
    (void)g

#define REQUIRE(ptr)                                                                               \
    if (!(ptr))                                                                                    \
    LEAVE(NVML_ERROR_INVALID_ARGUMENT)

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    DEVICE_CALL("nvmlDeviceGetUUID");
    LEAVE(copy_string(g->uuid, uuid, length));
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    DEVICE_CALL("nvmlDeviceGetName");
    LEAVE(copy_string(g->name, name, length));
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    DEVICE_CALL("nvmlDeviceGetIndex");
    REQUIRE(index);
    *index = (unsigned int)gpu;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor)
{
    DEVICE_CALL("nvmlDeviceGetMinorNumber");
    REQUIRE(minor);
    *minor = g->minor;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    DEVICE_CALL("nvmlDeviceGetMemoryInfo");
    REQUIRE(memory);
    memory->total = g->memory;
    memory->used = g->used;
    memory->free = g->memory > g->used ? g->memory - g->used : 0;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    DEVICE_CALL("nvmlDeviceGetMemoryInfo_v2");
    REQUIRE(memory);
    if (memory->version != nvmlMemory_v2)
        LEAVE(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    memory->total = g->memory;
    memory->reserved = 0;
    memory->used = g->used;
    memory->free = g->memory > g->used ? g->memory - g->used : 0;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    DEVICE_CALL("nvmlDeviceGetPciInfo_v3");
    REQUIRE(pci);
    memset(pci, 0, sizeof(*pci));
    snprintf(pci->busId, sizeof(pci->busId), "%s", g->pci);
    unsigned int dom = 0, bus = 0, dev = 0;
    sscanf(g->pci, "%x:%x:%x", &dom, &bus, &dev);
    pci->domain = dom;
    pci->bus = bus;
    pci->device = dev;
    pci->pciDeviceId = 0x20B210DE;
    snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT, dom,
             bus, dev);
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor)
{
    DEVICE_CALL("nvmlDeviceGetCudaComputeCapability");
    REQUIRE(major && minor);
    *major = g->cc_major;
    *minor = g->cc_minor;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending)
{
    DEVICE_CALL("nvmlDeviceGetMigMode");
    REQUIRE(current && pending);
    if (g->cc_major < 8)
        LEAVE(NVML_ERROR_NOT_SUPPORTED); /* MIG exists from Ampere on */
    *current = *pending = g->mig ? NVML_DEVICE_MIG_ENABLE : NVML_DEVICE_MIG_DISABLE;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node)
{
    DEVICE_CALL("nvmlDeviceGetNumaNodeId");
    REQUIRE(node);
    if (g->numa == -2)
        LEAVE(NVML_ERROR_NOT_SUPPORTED);
    *node = (unsigned int)g->numa;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *util)
{
    DEVICE_CALL("nvmlDeviceGetUtilizationRates");
    REQUIRE(util);
    util->gpu = g->util;
    util->memory = g->memutil;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, nvmlTemperatureSensors_t sensor,
                                      unsigned int *temp)
{
    DEVICE_CALL("nvmlDeviceGetTemperature");
    REQUIRE(temp);
    if (sensor != NVML_TEMPERATURE_GPU)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *temp = g->temp;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power)
{
    DEVICE_CALL("nvmlDeviceGetPowerUsage");
    REQUIRE(power);
    *power = g->power_mw;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
                                             nvmlProcessUtilizationSample_t *utilization,
                                             unsigned int *count, unsigned long long lastSeen)
{
    DEVICE_CALL("nvmlDeviceGetProcessUtilization");
    REQUIRE(count);
    if (!g->procutil_supported || g->mig)
        LEAVE(NVML_ERROR_NOT_SUPPORTED);
    unsigned int n = 0;
    for (unsigned int i = 0; i < config.nsamples; i++)
        if (config.samples[i].gpu == (unsigned int)gpu && config.samples[i].ts > lastSeen)
            n++;
    if (n == 0) {
        *count = 0;
        LEAVE(NVML_ERROR_NOT_FOUND);
    }
    if (!utilization || *count < n) {
        *count = n;
        LEAVE(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    unsigned int out = 0;
    for (unsigned int i = 0; i < config.nsamples; i++) {
        const struct fake_sample *s = &config.samples[i];
        if (s->gpu != (unsigned int)gpu || s->ts <= lastSeen)
            continue;
        nvmlProcessUtilizationSample_t *d = &utilization[out++];
        memset(d, 0, sizeof(*d));
        d->pid = s->pid;
        d->timeStamp = s->ts;
        d->smUtil = s->sm;
        d->memUtil = s->mem;
    }
    *count = out;
    LEAVE(NVML_SUCCESS);
}

static nvmlReturn_t running_processes(int gpu, unsigned int *count, nvmlProcessInfo_t *infos)
{
    unsigned int n = 0;
    for (unsigned int i = 0; i < config.nprocs; i++)
        if (config.procs[i].gpu == (unsigned int)gpu)
            n++;
    if (n == 0) {
        *count = 0;
        return NVML_SUCCESS;
    }
    if (!infos || *count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    unsigned int out = 0;
    for (unsigned int i = 0; i < config.nprocs; i++) {
        if (config.procs[i].gpu != (unsigned int)gpu)
            continue;
        nvmlProcessInfo_t *d = &infos[out++];
        memset(d, 0, sizeof(*d));
        d->pid = config.procs[i].pid;
        d->usedGpuMemory = config.procs[i].used;
        d->gpuInstanceId = 0xFFFFFFFF;
        d->computeInstanceId = 0xFFFFFFFF;
    }
    *count = out;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                     nvmlProcessInfo_t *infos)
{
    DEVICE_CALL("nvmlDeviceGetComputeRunningProcesses_v3");
    REQUIRE(count);
    LEAVE(running_processes(gpu, count, infos));
}

/* ---- events ------------------------------------------------------------------------------ */

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    nvmlReturn_t rc = enter_system("nvmlEventSetCreate");
    if (rc != NVML_SUCCESS)
        return rc;
    REQUIRE(set);
    struct nvmlEventSet_st *s = calloc(1, sizeof(*s));
    if (!s)
        LEAVE(NVML_ERROR_MEMORY);
    /* like the driver, a new set only sees events that happen after it exists */
    struct stat st;
    if (events_path[0] && stat(events_path, &st) == 0)
        s->offset = (long)st.st_size;
    *set = s;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *types)
{
    DEVICE_CALL("nvmlDeviceGetSupportedEventTypes");
    REQUIRE(types);
    *types = g->events;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long types,
                                      nvmlEventSet_t set)
{
    DEVICE_CALL("nvmlDeviceRegisterEvents");
    REQUIRE(set);
    if (types & ~g->events)
        LEAVE(NVML_ERROR_NOT_SUPPORTED);
    set->masks[gpu] |= types;
    LEAVE(NVML_SUCCESS);
}

/* Consume complete lines from the events file; fill *data with the first deliverable one. */
static int next_event_locked(nvmlEventSet_t set, nvmlEventData_t *data)
{
    if (!events_path[0])
        return 0;
    FILE *f = fopen(events_path, "r");
    if (!f)
        return 0;
    struct stat st;
    if (fstat(fileno(f), &st) == 0 && st.st_size < set->offset)
        set->offset = 0; /* the file was truncated or replaced */
    fseek(f, set->offset, SEEK_SET);
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    int found = 0;
    while (!found && (len = getline(&line, &cap, f)) > 0) {
        if (line[len - 1] != '\n')
            break; /* a line still being written: read it next time */
        set->offset += (long)len;
        char uuid[96];
        unsigned long long xid;
        if (sscanf(line, "%95s %llu", uuid, &xid) != 2)
            continue;
        int gi = find_gpu(&config, uuid);
        if (gi < 0 || !(set->masks[gi] & nvmlEventTypeXidCriticalError))
            continue;
        memset(data, 0, sizeof(*data));
        data->device = &devices[gi];
        data->eventType = nvmlEventTypeXidCriticalError;
        data->eventData = xid;
        data->gpuInstanceId = 0xFFFFFFFF;
        data->computeInstanceId = 0xFFFFFFFF;
        found = 1;
    }
    free(line);
    fclose(f);
    return found;
}

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    long long deadline = now_ns() + (long long)timeoutms * 1000000LL;
    for (;;) {
        nvmlReturn_t rc = enter_system("nvmlEventSetWait_v2");
        if (rc != NVML_SUCCESS)
            return rc;
        REQUIRE(set && data);
        int found = next_event_locked(set, data);
        pthread_mutex_unlock(&lock);
        if (found)
            return NVML_SUCCESS;
        long long left = deadline - now_ns();
        if (left <= 0)
            return NVML_ERROR_TIMEOUT;
        /* sleep, never spin: the lock is released so queries run meanwhile */
        long long step = left < EVENT_POLL_NS ? left : EVENT_POLL_NS;
        struct timespec ts = {.tv_sec = 0, .tv_nsec = step};
        nanosleep(&ts, NULL);
    }
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    nvmlReturn_t rc = enter_system("nvmlEventSetFree");
    if (rc != NVML_SUCCESS)
        return rc;
    REQUIRE(set);
    free(set);
    LEAVE(NVML_SUCCESS);
}
