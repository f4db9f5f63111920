/*
 * shim_test_launch.c - tests of what launches cost: cuGetProcAddress versions and trampolines,
 * graphs priced by their kernel nodes, stream capture, legacy and multi-device launches.
 * Included by shim_test.c (it uses its region, client and assertion functions).
 */

/* tokens spent on region device `dev` once every client has exited (counters are flushed at exit) */
static uint64_t spent_on(const char *region, int dev)
{
    struct vgpu_state *s = map_state(region);
    if (s == NULL)
        return UINT64_MAX;
    uint64_t v = s->devices[dev].tokens_spent;
    munmap(s, sizeof *s);
    return v;
}

/* strict policy, tokens always there: every launch is counted at its cost and never waits */
static struct dev_cfg ample(uint64_t graph_cost)
{
    struct dev_cfg c = {0, 0, 500000, UINT64_C(1) << 61, UINT64_C(1) << 61, VGPU_POLICY_STRICT,
                        graph_cost};
    return c;
}

static const char *shim_src(void)
{
    const char *s = getenv("VGPU_SHIM_SRC");
    return s != NULL && *s ? s : ".";
}

/* ------------------------------------------------------------------ versions.def, hooks.def */

struct vrow {
    char base[64], name[64], pt[64];
    int since, pt_since;
};

static int read_versions(struct vrow *rows, int max)
{
    char path[600], line[512];
    snprintf(path, sizeof path, "%s/src/versions.def", shim_src());
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return -1;
    int n = 0;
    while (fgets(line, sizeof line, f) != NULL && n < max) {
        struct vrow r;
        memset(&r, 0, sizeof r);
        char pt[80] = "";
        if (sscanf(line, "VERSION(\"%63[^\"]\", %d, \"%63[^\"]\", %79[^,], %d)", r.base, &r.since,
                   r.name, pt, &r.pt_since) != 5)
            continue;
        if (pt[0] == '"')
            snprintf(r.pt, sizeof r.pt, "%.*s", (int)strlen(pt) - 2, pt + 1);
        rows[n++] = r;
    }
    fclose(f);
    return n;
}

static int read_hooks(char names[][64], int max)
{
    char path[600], line[512];
    snprintf(path, sizeof path, "%s/src/hooks.def", shim_src());
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return -1;
    int n = 0;
    while (fgets(line, sizeof line, f) != NULL && n < max)
        if (sscanf(line, "HOOK(%63[^,],", names[n]) == 1)
            n++;
    fclose(f);
    return n;
}

static bool hooked(char names[][64], int n, const char *name)
{
    for (int i = 0; i < n; i++)
        if (strcmp(names[i], name) == 0)
            return true;
    return false;
}

/* the documented rule, on the table: the newest version <= v; its per-thread form if asked */
static const char *expected_name(const struct vrow *rows, int n, const char *base, int v, bool pt)
{
    const struct vrow *best = NULL;
    for (int i = 0; i < n; i++)
        if (strcmp(rows[i].base, base) == 0 && rows[i].since <= v &&
            (best == NULL || rows[i].since > best->since))
            best = &rows[i];
    if (best == NULL)
        return NULL;
    return pt && best->pt[0] && v >= best->pt_since ? best->pt : best->name;
}

static bool t_every_hook_has_versions(void)
{
    static struct vrow rows[256];
    static char hooks[256][64];
    int nv = read_versions(rows, 256), nh = read_hooks(hooks, 256);
    CHECK(nv > 0 && nh > 0, "cannot read %s/src/versions.def or hooks.def", shim_src());
    for (int h = 0; h < nh; h++) {
        if (strncmp(hooks[h], "cu", 2) != 0)
            continue;
        bool found = false;
        for (int i = 0; i < nv && !found; i++)
            found = strcmp(rows[i].name, hooks[h]) == 0 || strcmp(rows[i].pt, hooks[h]) == 0;
        CHECK(found, "hook %s has no row in versions.def", hooks[h]);
    }
    return true;
}

/* versions.def against the CUDA toolkit's own table of entry-point versions, where installed */
static bool t_versions_match_cuda_typedefs(void)
{
    static struct vrow rows[256];
    int nv = read_versions(rows, 256);
    CHECK(nv > 0, "cannot read versions.def");
    const char *candidates[] = {getenv("CUDA_TYPEDEFS_H"), "/usr/local/cuda/include/cudaTypedefs.h"};
    FILE *f = NULL;
    for (size_t i = 0; i < 2 && f == NULL; i++)
        if (candidates[i] != NULL)
            f = fopen(candidates[i], "r");
    if (f == NULL) {
        printf("#   no cudaTypedefs.h here: skipped\n");
        return true;
    }
    static char text[1 << 21];
    size_t len = fread(text, 1, sizeof text - 1, f);
    text[len] = '\0';
    fclose(f);
    for (int i = 0; i < nv; i++) {
        char want[160];
        snprintf(want, sizeof want, "PFN_%.63s_v%d)", rows[i].base, rows[i].since);
        CHECK(strstr(text, want) != NULL, "versions.def: %s since %d, but cudaTypedefs.h has no %s",
              rows[i].name, rows[i].since, want);
        if (rows[i].pt[0]) {
            snprintf(want, sizeof want, "PFN_%.63s_v%d_ptsz)", rows[i].base, rows[i].pt_since);
            CHECK(strstr(text, want) != NULL, "versions.def: %s, but cudaTypedefs.h has no %s",
                  rows[i].pt, want);
        }
    }
    /* and every version cudaTypedefs.h lists for these bases is a row */
    for (int i = 0; i < nv; i++) {
        char pat[128];
        snprintf(pat, sizeof pat, "PFN_%.63s_v", rows[i].base);
        for (const char *p = strstr(text, pat); p != NULL; p = strstr(p + 1, pat)) {
            int v = atoi(p + strlen(pat));
            bool found = false;
            for (int j = 0; j < nv && !found; j++)
                found = strcmp(rows[j].base, rows[i].base) == 0 && rows[j].since == v;
            const char *after = p + strlen(pat);
            while (*after >= '0' && *after <= '9')
                after++;
            bool ptsz = strncmp(after, "_ptsz", 5) == 0 || strncmp(after, "_ptds", 5) == 0;
            if (*after != ')' && !ptsz)
                continue; /* another base with this prefix */
            for (int j = 0; j < nv && !found && ptsz; j++)
                found = strcmp(rows[j].base, rows[i].base) == 0 && rows[j].pt_since == v;
            CHECK(found, "cudaTypedefs.h has %s%d%s, versions.def has no such row", pat, v,
                  ptsz ? "_ptsz" : "");
        }
    }
    return true;
}

/* cuGetProcAddress(_v2) hands out, for every row of every hooked base, at its first version and at
 * CUDA 13.0, with and without the per-thread flag: the hook of exactly the ABI the rule selects, or
 * the driver's own function when that ABI is not hooked. `trampolines`: the driver returns internal
 * stubs, never its exports (the shim cannot compare addresses and must apply the rule itself). */
static bool t_procaddr_versions(bool trampolines)
{
    static struct vrow rows[256];
    static char hooks[256][64];
    int nv = read_versions(rows, 256), nh = read_hooks(hooks, 256);
    CHECK(nv > 0 && nh > 0, "cannot read versions.def / hooks.def");
    make_region("gpa", 1, &MEM64);
    static char store[4096][48];
    static char *args[4200];
    int na = 0, ns = 0, probes = 0;
    args[na++] = "direct";
    for (int i = 0; i < nv; i++) {
        bool base_hooked = false;
        for (int j = 0; j < nv; j++)
            if (strcmp(rows[j].base, rows[i].base) == 0)
                base_hooked |= hooked(hooks, nh, rows[j].name) || hooked(hooks, nh, rows[j].pt);
        if (!base_hooked)
            continue; /* the fake driver need not know bases the shim leaves alone */
        int versions[3] = {rows[i].since, 13000, rows[i].pt_since};
        for (int k = 0; k < 3; k++) {
            if (versions[k] == 0)
                continue;
            for (int pt = 0; pt < 2; pt++) {
                const char *name = expected_name(rows, nv, rows[i].base, versions[k], pt);
                if (name == NULL || ns + 3 > 4096 || na + 6 > 4200)
                    continue;
                snprintf(store[ns], 48, "%d", versions[k]);
                args[na++] = "gpa";
                args[na++] = rows[i].base;
                args[na++] = store[ns++];
                args[na++] = pt ? "pt" : "default";
                if (hooked(hooks, nh, name)) {
                    snprintf(store[ns], 48, "hook:%s", name);
                    args[na++] = store[ns++];
                } else {
                    args[na++] = "nothook";
                }
                probes++;
            }
        }
        /* below the first version there is nothing, hooked or not */
        if (rows[i].since > 2000 && expected_name(rows, nv, rows[i].base, rows[i].since - 1, 0) == NULL) {
            snprintf(store[ns], 48, "%d", rows[i].since - 1);
            args[na++] = "gpa";
            args[na++] = rows[i].base;
            args[na++] = store[ns++];
            args[na++] = "pt";
            args[na++] = "notfound";
            probes++;
        }
    }
    args[na] = NULL;
    struct run r;
    char *env_tramp[] = {"FAKE_CUDA_TRAMPOLINES=1", NULL};
    run_client(&r, "gpa", trampolines ? env_tramp : NOENV, args);
    printf("#   %d lookups (%s)\n", probes, trampolines ? "trampolines" : "exports");
    return client_ok(&r);
}

/* the old fallback handed a non-stream hook only to legacy requests: with the per-thread flag every
 * memory hook came back unhooked. Through trampolines, the per-thread way still limits memory. */
static bool t_per_thread_trampolines_limit_memory(void)
{
    struct dev_cfg cfg = MEM64;
    cfg.memory_limit = 256 * MiB;
    make_region("ptmem", 1, &cfg);
    struct run r;
    char *env[] = {"FAKE_CUDA_TRAMPOLINES=1", NULL};
    run_client(&r, "ptmem", env,
               ARGS("procaddr_ptsz", "ctx", "0", "totalmem", "0", "256M", "alloc", "plain", "128M",
                    "ok", "alloc", "pitch", "200M", "oom", "alloc", "async", "32M", "ok", "alloc",
                    "create", "200M", "oom", "info", "256M", "-", "free", "ok", "free", "ok",
                    "alloc", "plain", "200M", "ok", "free", "ok", "launch", "kernel", "3", "10",
                    "100", "ok"));
    if (!client_ok(&r))
        return false;
    CHECK(spent_on("ptmem", 0) == 3000, "per-thread launches through trampolines spent %llu, "
          "expected 3000", (unsigned long long)spent_on("ptmem", 0));
    return true;
}

/* ------------------------------------------------------------------ graphs */

/* a graph costs the sum of its kernels, child graphs included, whichever instantiate made it */
static bool t_graph_priced_by_kernels(const char *way, const char *how)
{
    struct dev_cfg cfg = ample(7);
    make_region("gprice", 1, &cfg);
    struct run r;
    /* g0: 10x100 + 20x32 + child(g1: 4x256) + empty = 1000 + 640 + 1024 */
    run_client(&r, "gprice", NOENV,
               ARGS((char *)way, "ctx", "0", "gnew", "1", "gkernel", "1", "4", "256", "gnew", "0",
                    "gkernel", "0", "10", "100", "gkernel", "0", "20", "32", "gchild", "0", "1",
                    "gempty", "0", "ginst", "0", "0", (char *)how, "ok", "glaunch", "0", "3", "null",
                    "ok", "counter", "graph_kernels", "9"));
    if (!client_ok(&r))
        return false;
    struct vgpu_state *s = map_state("gprice");
    uint64_t unpriced = s->ext[0].graphs_unpriced;
    munmap(s, sizeof *s);
    CHECK(unpriced == 0, "a readable graph counted as unpriced (%llu)", (unsigned long long)unpriced);
    uint64_t spent = spent_on("gprice", 0);
    CHECK(spent == 3 * 2664, "3 launches of a graph of 2664 threads (%s, %s) spent %llu", way, how,
          (unsigned long long)spent);
    return true;
}

/* in-place updates of the executable graph move its price with it */
static bool t_graph_updates(const char *way, const char *setk)
{
    struct dev_cfg cfg = ample(7);
    make_region("gupd", 1, &cfg);
    struct run r;
    /* nodes: 0 = g1's kernel (4x256); 1, 2 = g0's kernels; 3 = g0's child; 4 = g2's kernel;
     * 5 = g3's kernel; 6..8 = g4's; 9 = the child's kernel inside the executable's source */
    run_client(&r, "gupd", NOENV,
               ARGS((char *)way, "ctx", "0", "gnew", "1", "gkernel", "1", "4", "256", "gnew", "0",
                    "gkernel", "0", "10", "100", "gkernel", "0", "20", "32", "gchild", "0", "1",
                    "gnew", "2", "gkernel", "2", "1", "1000", "gnew", "3", "gkernel", "3", "1", "4",
                    "gnew", "4", "gkernel", "4", "1", "1", "gkernel", "4", "1", "2", "gchild", "4",
                    "3", "ginst", "0", "0", "v2", "ok",
                    /* 1000 + 640 + 1024 */
                    "glaunch", "0", "1", "null", "ok",
                    /* first kernel 10x100 -> 5x100: 500 + 640 + 1024 */
                    "gsetk", "0", "1", "5", "100", (char *)setk, "ok", "glaunch", "0", "1", "null",
                    "ok",
                    /* the child's own kernel 4x256 -> 2x128: 500 + 640 + 256 */
                    "ginner", "3", "gsetk", "0", "9", "2", "128", (char *)setk, "ok", "glaunch",
                    "0", "1", "null", "ok",
                    /* second kernel disabled: 500 + 256 */
                    "genable", "0", "2", "0", "ok", "glaunch", "0", "1", "null", "ok",
                    /* the child takes g2's parameters (1x1000): 500 + 1000 */
                    "gsetchild", "0", "3", "2", "direct", "ok", "glaunch", "0", "1", "null", "ok",
                    /* the whole executable takes g4's parameters: 1 + (disabled 2) + 4 */
                    "gupdate", "0", "4", "ok", "glaunch", "0", "1", "null", "ok",
                    /* an update of another topology fails and changes nothing */
                    "gupdate", "0", "2", "910", "glaunch", "0", "1", "null", "ok",
                    /* a destroyed executable is forgotten; a new one is priced afresh */
                    "gdestroy", "0", "ginst", "0", "2", "flags", "ok", "glaunch", "0", "1", "null",
                    "ok"));
    if (!client_ok(&r))
        return false;
    uint64_t want = 2664 + 2164 + 1396 + 756 + 1500 + 5 + 5 + 1000;
    uint64_t spent = spent_on("gupd", 0);
    CHECK(spent == want, "updates via %s (%s): spent %llu, expected %llu", way, setk,
          (unsigned long long)spent, (unsigned long long)want);
    return true;
}

/* graphs that cannot be read cost max(readable part, graph_cost) and are counted once each */
static bool t_graph_unpriced(void)
{
    struct dev_cfg cfg = ample(50000);
    make_region("gunp", 1, &cfg);
    struct run r;
    run_client(&r, "gunp", NOENV,
               ARGS("direct", "ctx", "0",
                    /* a conditional node: 1000 readable, priced at the floor 50000 */
                    "gnew", "0", "gkernel", "0", "10", "100", "gcond", "0", "ginst", "0", "0",
                    "flags", "ok", "glaunch", "0", "2", "null", "ok",
                    /* a big graph with a conditional node: its readable 60000 */
                    "gnew", "1", "gkernel", "1", "600", "100", "gcond", "1", "ginst", "1", "1",
                    "flags", "ok", "glaunch", "1", "1", "null", "ok",
                    /* kernel parameters unreadable: the floor */
                    "queryfail", "1", "gnew", "2", "gkernel", "2", "1", "10", "ginst", "2", "2",
                    "flags", "ok", "queryfail", "0", "glaunch", "2", "1", "null", "ok",
                    /* a readable graph, for contrast: 10 */
                    "ginst", "3", "2", "flags", "ok", "glaunch", "3", "1", "null", "ok"));
    if (!client_ok(&r))
        return false;
    uint64_t want = 2 * 50000 + 60000 + 50000 + 10;
    uint64_t spent = spent_on("gunp", 0);
    CHECK(spent == want, "unpriced graphs spent %llu, expected %llu", (unsigned long long)spent,
          (unsigned long long)want);
    struct vgpu_state *s = map_state("gunp");
    uint64_t unpriced = s->ext[0].graphs_unpriced;
    munmap(s, sizeof *s);
    CHECK(unpriced == 3, "3 unpriced executable graphs (one launched twice), the state counts %llu",
          (unsigned long long)unpriced);
    return true;
}

/* the same kernels as a graph and one by one spend the same tokens */
static bool t_graph_equals_kernels(void)
{
    struct dev_cfg cfg = ample(0);
    make_region("geq", 1, &cfg);
    static char *args[400];
    static char nums[200][8];
    int na = 0;
    args[na++] = "direct";
    args[na++] = "ctx";
    args[na++] = "0";
    args[na++] = "gnew";
    args[na++] = "0";
    for (int k = 0; k < 50; k++) {
        snprintf(nums[k], 8, "%d", 1 + (k * 37) % 97);
        args[na++] = "gkernel";
        args[na++] = "0";
        args[na++] = nums[k];
        args[na++] = k % 2 ? "256" : "64";
    }
    char *tail[] = {"ginst", "0", "0", "flags", "ok", "glaunch", "0", "20", "null", "ok", NULL};
    for (int k = 0; tail[k] != NULL; k++)
        args[na++] = tail[k];
    args[na] = NULL;
    struct run r;
    run_client(&r, "geq", NOENV, args);
    if (!client_ok(&r))
        return false;
    uint64_t graph = spent_on("geq", 0);
    /* the same 50 kernels, 20 times, one launch each */
    make_region("geq", 1, &cfg);
    uint64_t want = 0;
    for (int k = 0; k < 50; k++)
        want += (uint64_t)(1 + (k * 37) % 97) * (k % 2 ? 256 : 64);
    char *one[400];
    int n1 = 0;
    one[n1++] = "direct";
    one[n1++] = "ctx";
    one[n1++] = "0";
    for (int k = 0; k < 50; k++) {
        one[n1++] = "launch";
        one[n1++] = "kernel";
        one[n1++] = "20";
        one[n1++] = nums[k];
        one[n1++] = k % 2 ? "256" : "64";
        one[n1++] = "ok";
    }
    one[n1] = NULL;
    run_client(&r, "geq", NOENV, one);
    if (!client_ok(&r))
        return false;
    uint64_t single = spent_on("geq", 0);
    printf("#   a graph of 50 kernels x20: %llu tokens; the kernels one by one: %llu\n",
           (unsigned long long)graph, (unsigned long long)single);
    CHECK(graph == single && single == 20 * want, "graph %llu, one by one %llu, expected %llu",
          (unsigned long long)graph, (unsigned long long)single, (unsigned long long)(20 * want));
    return true;
}

/* ------------------------------------------------------------------ capture */

/* with an empty bucket (1 token/s), capturing 1000 kernels and a graph is immediate and free; the
 * captured graph's launch pays for all of them */
static bool t_capture_costs_nothing(const char *way, const char *stream, const char *mode)
{
    struct dev_cfg cfg = {0, 0, 500000, 1, 1, VGPU_POLICY_STRICT, 0};
    make_region("capt", 1, &cfg);
    struct run r;
    /* the executable graph launched inside the capture: 1x10 threads */
    bool pt = strcmp(stream, "pt") == 0 || strcmp(way, "procaddr_ptsz") == 0;
    char *target = pt && strcmp(stream, "pt") != 0 ? "null" : (char *)stream;
    run_client(&r, "capt", NOENV,
               ARGS((char *)way, "ctx", "0", "stream", "0", "gnew", "5", "gkernel", "5", "1",
                    "10", "ginst", "5", "5", "v2", "ok", "capture", target, (char *)mode, "ok",
                    "launchon", target, "1000", "10", "100", "ok", "glaunch", "5", "1", target,
                    "ok", "endcapture", target, "0", "ok", "counter", "captured", "1001",
                    "counter", "launch", "0"));
    if (!client_ok(&r))
        return false;
    unsigned long long ns = 0;
    const char *line = strstr(r.out, "launchon ");
    CHECK(line && sscanf(line, "launchon ns=%llu", &ns) == 1, "no timing in %s", r.out);
    uint64_t spent = spent_on("capt", 0);
    CHECK(spent == 0, "capturing spent %llu tokens (%s, %s, %s)", (unsigned long long)spent, way,
          stream, mode);
    CHECK(ns < 500000000ull, "capturing 1000 kernels with an empty bucket took %llu ns", ns);
    printf("#   %s %s %s: 1000 captured launches in %.2f ms, 0 tokens\n", way, stream, mode,
           (double)ns / 1e6);
    return true;
}

/* the captured graph, instantiated and launched, costs its kernels; a launch into the legacy stream
 * while a blocking stream is captured globally is refused by the driver and spends nothing */
static bool t_captured_graph_paid_at_launch(void)
{
    struct dev_cfg cfg = ample(7);
    make_region("captpay", 1, &cfg);
    struct run r;
    run_client(&r, "captpay", NOENV,
               ARGS("direct", "ctx", "0", "stream", "0", "gnew", "5", "gkernel", "5", "1", "10",
                    "ginst", "5", "5", "flags", "ok", "capture", "0", "global", "ok", "launchon",
                    "0", "100", "10", "100", "ok", "glaunch", "5", "1", "0", "ok", "launchon",
                    "null", "1", "10", "100", "906", "endcapture", "0", "0", "901", "capture", "0",
                    "global", "ok", "launchon", "0", "100", "10", "100", "ok", "glaunch", "5", "2",
                    "0", "ok", "endcapture", "0", "0", "ok", "ginst", "1", "0", "flags", "ok",
                    "glaunch", "1", "3", "null", "ok"));
    if (!client_ok(&r))
        return false;
    uint64_t spent = spent_on("captpay", 0), want = 3 * (100 * 1000 + 2 * 10);
    CHECK(spent == want, "captured graph: spent %llu, expected %llu", (unsigned long long)spent,
          (unsigned long long)want);
    return true;
}

/* ------------------------------------------------------------------ legacy, multi-device */

static bool t_legacy_launches(const char *way)
{
    struct dev_cfg cfg = ample(7);
    make_region("legacy", 1, &cfg);
    struct run r;
    run_client(&r, "legacy", NOENV,
               ARGS((char *)way, "ctx", "0", "blockshape", "16", "8", "1", "legacy", "launch", "2",
                    "1", "1", "ok", "legacy", "grid", "3", "4", "2", "ok", "legacy", "gridasync",
                    "1", "3", "1", "ok", "blockshape", "32", "1", "1", "legacy", "grid", "1", "10",
                    "1", "ok", "counter", "legacy", "7"));
    if (!client_ok(&r))
        return false;
    uint64_t want = 2 * 128 + 3 * 8 * 128 + 3 * 128 + 10 * 32;
    uint64_t spent = spent_on("legacy", 0);
    CHECK(spent == want, "legacy launches via %s spent %llu, expected %llu", way,
          (unsigned long long)spent, (unsigned long long)want);
    return true;
}

static bool t_legacy_launch_paced(void)
{
    /* cuLaunchGrid of 10 blocks x 100 threads at 2e6 tokens/s: within 5% of the rate */
    const uint64_t rate = 2000000;
    struct dev_cfg cfg = {0, 0, 300000, rate, rate / 10, VGPU_POLICY_STRICT, 0};
    make_region("legpace", 1, &cfg);
    struct run r;
    run_client(&r, "legpace", NOENV,
               ARGS("dlsym", "ctx", "0", "blockshape", "100", "1", "1", "legacy", "grid", "200",
                    "10", "1", "ok"));
    if (!client_ok(&r))
        return false;
    /* the burst (200000) was spent above; 2000 more launches of 1000 take 1 s */
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    run_client(&r, "legpace", NOENV,
               ARGS("dlsym", "ctx", "0", "blockshape", "100", "1", "1", "legacy", "grid", "2000",
                    "10", "1", "ok"));
    clock_gettime(CLOCK_MONOTONIC, &b);
    if (!client_ok(&r))
        return false;
    double s = (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) / 1e9;
    printf("#   2000 cuLaunchGrid of 1000 threads at 2e6/s took %.3f s (expected ~1)\n", s);
    CHECK(s > 0.85 && s < 1.5, "2000 legacy launches of cost 1000 at rate 2e6 took %.3f s", s);
    return true;
}

static bool t_multidevice_launch(void)
{
    struct dev_cfg cfg[2] = {ample(7), ample(7)};
    cfg[1].fake_dev = 1;
    make_region("multi", 2, cfg);
    struct run r;
    run_client(&r, "multi", NOENV,
               ARGS("direct", "ctx", "1", "stream", "1", "ctx", "0", "stream", "0", "multidev", "0",
                    "1", "10", "100", "ok", "multidev", "0", "1", "3", "64", "ok", "counter",
                    "multidev", "4"));
    if (!client_ok(&r))
        return false;
    uint64_t d0 = spent_on("multi", 0), d1 = spent_on("multi", 1);
    CHECK(d0 == 1192 && d1 == 1192, "multi-device launches spent %llu on device 0 and %llu on "
          "device 1, expected 1192 each", (unsigned long long)d0, (unsigned long long)d1);
    return true;
}

static void run_launch_tests(void)
{
    char name[160];
    report("every hooked entry point has its versions", t_every_hook_has_versions());
    report("versions.def matches the CUDA toolkit's entry-point versions",
           t_versions_match_cuda_typedefs());
    report("cuGetProcAddress: the hook of the requested ABI, exports",
           t_procaddr_versions(false));
    report("cuGetProcAddress: the hook of the requested ABI, driver trampolines",
           t_procaddr_versions(true));
    report("per-thread cuGetProcAddress through trampolines still limits memory",
           t_per_thread_trampolines_limit_memory());
    static const char *const inst[][2] = {{"direct", "v1"},           {"direct", "v2"},
                                          {"direct", "flags"},        {"direct", "params"},
                                          {"dlsym", "params_ptsz"},   {"procaddr", "params"},
                                          {"procaddr_ptsz", "params"}, {"procaddr_v1", "v2"}};
    for (size_t i = 0; i < sizeof inst / sizeof inst[0]; i++) {
        snprintf(name, sizeof name, "a graph costs the sum of its kernels (%s, instantiate %s)",
                 inst[i][0], inst[i][1]);
        report(name, t_graph_priced_by_kernels(inst[i][0], inst[i][1]));
    }
    static const char *const upd[][2] = {
        {"direct", "v2"}, {"procaddr", "generic"}, {"procaddr_v1", "v1"}, {"dlsym", "v1"}};
    for (size_t i = 0; i < sizeof upd / sizeof upd[0]; i++) {
        snprintf(name, sizeof name, "executable graph updates move its price (%s, %s)", upd[i][0],
                 upd[i][1]);
        report(name, t_graph_updates(upd[i][0], upd[i][1]));
    }
    report("unreadable graphs cost at least graph_cost", t_graph_unpriced());
    report("a graph spends what its kernels one by one spend", t_graph_equals_kernels());
    static const char *const capt[][3] = {{"direct", "0", "global"},
                                          {"dlsym", "0", "thread"},
                                          {"procaddr", "0", "relaxed"},
                                          {"direct", "pt", "global"},
                                          {"procaddr_ptsz", "null", "global"}};
    for (size_t i = 0; i < sizeof capt / sizeof capt[0]; i++) {
        snprintf(name, sizeof name, "capture spends nothing and never waits (%s, stream %s, %s)",
                 capt[i][0], capt[i][1], capt[i][2]);
        report(name, t_capture_costs_nothing(capt[i][0], capt[i][1], capt[i][2]));
    }
    report("a captured graph is paid when launched; implicit legacy launches spend nothing",
           t_captured_graph_paid_at_launch());
    report("legacy launches cost grid x cuFuncSetBlockShape (direct)", t_legacy_launches("direct"));
    report("legacy launches cost grid x cuFuncSetBlockShape (procaddr)",
           t_legacy_launches("procaddr"));
    report("legacy launches are paced", t_legacy_launch_paced());
    report("multi-device cooperative launches pay on each device", t_multidevice_launch());
}

/* ------------------------------------------------------------------ fair turns */

/* A state file as a 1.0 agent writes it: no extension (no ticket words, no counters). */
static void make_region_1_0(const char *name, int ndev, const struct dev_cfg *cfg)
{
    make_region(name, ndev, cfg);
    char path[600];
    region_path(path, sizeof path, name, "state");
    int fd = open(path, O_RDWR);
    uint32_t minor = 0;
    uint64_t total = VGPU_STATE_SIZE_1_0;
    if (fd < 0 || ftruncate(fd, (off_t)VGPU_STATE_SIZE_1_0) != 0 ||
        pwrite(fd, &minor, sizeof minor, offsetof(struct vgpu_state, abi_minor)) != 4 ||
        pwrite(fd, &total, sizeof total, offsetof(struct vgpu_state, total_size)) != 8) {
        perror(path);
        exit(2);
    }
    close(fd);
}

/* Two processes of one container spin on kernels of 1e6 threads (0.05 ms on the fake GPU at
 * 50 ps per thread) and 1e8 threads (5 ms), each on its own GPU timeline with up to 1 ms queued;
 * tokens/s each, from their slots' counters sampled after a settling second, over `window`
 * seconds (the start-up and the initial burst left out). */
static uint64_t slot_tokens(const struct vgpu_state *s, pid_t pid)
{
    for (int i = 0; i < VGPU_MAX_PROCS; i++)
        if (__atomic_load_n(&s->slots[i].pid, __ATOMIC_ACQUIRE) == (uint64_t)pid)
            return __atomic_load_n(&s->slots[i].devices[0].tokens_spent, __ATOMIC_RELAXED);
    return 0;
}

static bool mixed_run(const char *region, double window, double *fast, double *slow,
                      double *total)
{
    char secs[32];
    snprintf(secs, sizeof secs, "%.2f", window + 1.5);
    char *env[] = {"FAKE_CUDA_PS_PER_THREAD=50", NULL};
    pid_t pids[2];
    char outs[2][600], errs[2][600];
    for (int i = 0; i < 2; i++) {
        snprintf(outs[i], sizeof outs[i], "%s/mixed%d.out", g_tmp, i);
        snprintf(errs[i], sizeof errs[i], "%s/mixed%d.err", g_tmp, i);
        pids[i] = spawn(region, env,
                        ARGS(i == 0 ? "direct" : "procaddr", "ctx", "0", "spin", secs,
                             i == 0 ? "1000" : "100000", "1000"),
                        NULL, outs[i], errs[i]);
    }
    struct vgpu_state *s = map_state(region);
    struct timespec settle = {1, 0};
    nanosleep(&settle, NULL);
    double t1 = monotonic_s();
    uint64_t a1 = slot_tokens(s, pids[0]), b1 = slot_tokens(s, pids[1]);
    uint64_t all1 = __atomic_load_n(&s->devices[0].tokens_spent, __ATOMIC_RELAXED);
    struct timespec w = {(time_t)window, (long)((window - (double)(time_t)window) * 1e9)};
    nanosleep(&w, NULL);
    double t2 = monotonic_s();
    uint64_t a2 = slot_tokens(s, pids[0]), b2 = slot_tokens(s, pids[1]);
    uint64_t all2 = __atomic_load_n(&s->devices[0].tokens_spent, __ATOMIC_RELAXED);
    munmap(s, sizeof *s);
    for (int i = 0; i < 2; i++) {
        int status = wait_timeout(pids[i], 60);
        if (status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            char err[1024];
            read_all(errs[i], err, sizeof err);
            return failf("mixed workload process %d: status %#x, %s", i, status, err);
        }
    }
    *fast = (double)(a2 - a1) / (t2 - t1);
    *slow = (double)(b2 - b1) / (t2 - t1);
    *total = (double)(all2 - all1) / (t2 - t1);
    return true;
}

static bool t_fair_turns_mixed_workload(void)
{
    /* demand: what each process does alone on an unthrottled container */
    struct dev_cfg off = {0, 0, VGPU_CORE_LIMIT_FULL, 0, 0, VGPU_POLICY_OFF, 0};
    make_region("demand", 1, &off);
    double d_fast, d_slow, d_total; /* unthrottled they do not meet: each runs its own kernels */
    if (!mixed_run("demand", 1.0, &d_fast, &d_slow, &d_total))
        return false;
    /* the container gets half of what the two want together; a burst of 0.2 s of it absorbs a
     * busy machine's scheduling delays */
    uint64_t rate = (uint64_t)((d_fast + d_slow) / 2);
    struct dev_cfg cfg = {0, 0, 500000, rate, rate / 5, VGPU_POLICY_STRICT, 0};
    const double window = 2.0;
    double fast, slow, all, fast0, slow0, all0;
    make_region_1_0("unordered", 1, &cfg);
    if (!mixed_run("unordered", window, &fast0, &slow0, &all0))
        return false;
    make_region("turns", 1, &cfg);
    if (!mixed_run("turns", window, &fast, &slow, &all))
        return false;
    double want_slow = d_slow / (d_fast + d_slow);
    double share = slow / (fast + slow), share0 = slow0 / (fast0 + slow0);
    double total = all / (double)rate;
    printf("#   demand alone: 0.05 ms kernels %.3g tokens/s, 5 ms kernels %.3g tokens/s; "
           "container rate %.3g\n", d_fast, d_slow, (double)rate);
    printf("#   5 ms process's share: %.1f%% with turns, %.1f%% without (proportional to demand: "
           "%.1f%%); container total with turns %.3f of the rate\n",
           100 * share, 100 * share0, 100 * want_slow, total);
    CHECK(share >= 0.8 * want_slow && share <= 1.2 * want_slow,
          "the 5 ms process got %.1f%% of the container, its demand is %.1f%%", 100 * share,
          100 * want_slow);
    CHECK(1 - share >= 0.8 * (1 - want_slow) && 1 - share <= 1.2 * (1 - want_slow),
          "the 0.05 ms process got %.1f%%, its demand is %.1f%%", 100 * (1 - share),
          100 * (1 - want_slow));
    CHECK(total >= 0.9 && total <= 1.05, "with turns the container spent %.3f of its rate", total);
    return true;
}

/* a ticket holder that died (a ticket taken, never served) delays the others by at most
 * VGPU_MAX_WAIT_NS, once; damaged ticket words do not stop launches either */
static bool t_turns_survive_dead_holder(void)
{
    const uint64_t rate = 2000000;
    struct dev_cfg cfg = {0, 0, 300000, rate, rate / 10, VGPU_POLICY_STRICT, 0};
    make_region("deadturn", 1, &cfg);
    char path[600];
    region_path(path, sizeof path, "deadturn", "state");
    int fd = open(path, O_RDWR);
    struct vgpu_state *s = mmap(NULL, sizeof *s, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    CHECK(s != MAP_FAILED, "map state");
    s->ext[0].ticket_next = 5; /* tickets 0..4 were taken by processes now gone */
    s->ext[0].ticket_serving = 0;
    struct run r;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    /* 400 launches of 1000: the burst (200000) pays 200, the rest take 0.1 s at the rate */
    run_client(&r, "deadturn", NOENV, ARGS("direct", "ctx", "0", "launch", "kernel", "400", "10",
                                           "100", "ok"));
    clock_gettime(CLOCK_MONOTONIC, &b);
    double took = (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) / 1e9;
    bool ok = client_ok(&r);
    uint64_t next = s->ext[0].ticket_next, serving = s->ext[0].ticket_serving;
    if (ok && !(took < 2.0 + 0.5 && next == serving))
        ok = failf("with 5 dead tickets ahead: %.2f s, next %llu serving %llu", took,
                   (unsigned long long)next, (unsigned long long)serving);
    printf("#   5 dead tickets ahead: 400 launches in %.2f s\n", took);
    /* serving past next: damage, repaired at the next wait */
    s->ext[0].ticket_next = 3;
    s->ext[0].ticket_serving = 1000;
    if (ok) {
        clock_gettime(CLOCK_MONOTONIC, &a);
        run_client(&r, "deadturn", NOENV,
                   ARGS("direct", "ctx", "0", "launch", "kernel", "400", "10", "100", "ok"));
        clock_gettime(CLOCK_MONOTONIC, &b);
        took = (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) / 1e9;
        ok = client_ok(&r);
        if (ok && !(took < 1.0 && s->ext[0].ticket_next == s->ext[0].ticket_serving))
            ok = failf("damaged ticket words: %.2f s, next %llu serving %llu", took,
                       (unsigned long long)s->ext[0].ticket_next,
                       (unsigned long long)s->ext[0].ticket_serving);
    }
    munmap(s, sizeof *s);
    return ok;
}

/* 1.0 regions have no extension: graphs, capture and unpriced graphs still work, nothing counted */
static bool t_graphs_on_1_0_region(void)
{
    struct dev_cfg cfg = ample(50000);
    make_region_1_0("old", 1, &cfg);
    struct run r;
    run_client(&r, "old", NOENV,
               ARGS("direct", "ctx", "0", "gnew", "0", "gkernel", "0", "10", "100", "gcond", "0",
                    "ginst", "0", "0", "flags", "ok", "glaunch", "0", "1", "null", "ok", "gnew",
                    "1", "gkernel", "1", "10", "100", "ginst", "1", "1", "flags", "ok", "glaunch",
                    "1", "1", "null", "ok", "launch", "kernel", "4", "10", "100", "ok"));
    if (!client_ok(&r))
        return false;
    uint64_t spent = spent_on("old", 0);
    CHECK(spent == 50000 + 1000 + 4000, "on a 1.0 region: spent %llu, expected 55000",
          (unsigned long long)spent);
    return true;
}

/* launches that wait for turns survive fork (children launch while the parent's thread may hold
 * a turn) and a signal every 200 us (every sleep interrupted), and stay paced */
static bool t_turns_fork_and_signals(void)
{
    struct dev_cfg cfg = {0, 1ull << 30, 300000, 320000, 3200, VGPU_POLICY_STRICT, 0};
    make_region("turnfork", 1, &cfg);
    struct run r;
    run_client(&r, "turnfork", NOENV, ARGS("direct", "ctx", "0", fork_stress_command(), "20"));
    if (!client_ok(&r))
        return false;
    const uint64_t rate = 2000000;
    struct dev_cfg pace = {0, 0, 300000, rate, rate / 10, VGPU_POLICY_STRICT, 0};
    make_region("turnsig", 1, &pace);
    run_client(&r, "turnsig", NOENV,
               ARGS("direct", "ctx", "0", "itimer", "200", "pace", "kernel", "1.0", "10", "100",
                    "1000", "200000"));
    if (!client_ok(&r))
        return false;
    unsigned long long launches = 0, ns = 0;
    const char *line = strstr(r.out, "pace ");
    CHECK(line && sscanf(line, "pace launches=%llu ns=%llu", &launches, &ns) == 2, "no pace line");
    double ratio = (double)launches * 1000 / ((double)ns / 1e9) / (double)rate;
    printf("#   paced under a signal every 200 us: ratio %.4f\n", ratio);
    CHECK(ratio >= 0.95 && ratio <= 1.05, "under signals: %.3f of the rate", ratio);
    return true;
}

static void run_turn_tests(void)
{
    report("fair turns: fork under load and signals mid-wait", t_turns_fork_and_signals());
    report("fair turns: a mixed workload shares the container by demand",
           t_fair_turns_mixed_workload());
    report("fair turns: dead ticket holders and damaged words delay boundedly",
           t_turns_survive_dead_holder());
    report("graphs on a 1.0 region (no extension)", t_graphs_on_1_0_region());
}
