/*
 * policy_tests.c - what the container may change about its own enforcement: only what the
 * agent's control allows (control.flags). Included by shim_test.c, whose helpers it uses.
 *
 * The "mounted" tests preload a build of the shim whose mounted region directory is
 * BUILD/mounted-region (a symlink to the region a test plays the agent's mount with), since the
 * real /run/vgpu is not there on a test machine.
 */

static const struct dev_cfg OPEN_CFG = {0, 0, VGPU_CORE_LIMIT_FULL, 0, 0, VGPU_POLICY_OFF, 0};

static bool mount_region(const char *name)
{
    char link[600], target[600];
    snprintf(link, sizeof link, "%s/mounted-region", g_build);
    snprintf(target, sizeof target, "%s/%s", g_tmp, name);
    unlink(link);
    return symlink(target, link) == 0 || failf("symlink %s: %s", link, strerror(errno));
}

static void unmount_region(void)
{
    char link[600];
    snprintf(link, sizeof link, "%s/mounted-region", g_build);
    unlink(link);
}

/* VGPU_DISABLE=1 without the agent's leave: limits still hold, one warning says why. */
static bool t_disable_needs_the_agents_leave(uint32_t minor, uint64_t flags)
{
    g_control_minor = minor;
    g_control_flags = flags;
    make_region("nodisable", 1, &MEM64);
    g_control_minor = VGPU_ABI_MINOR;
    g_control_flags = 0;
    struct run r;
    char *env[] = {"VGPU_DISABLE=1", NULL};
    run_client(&r, "nodisable", env,
               ARGS("direct", "ctx", "0", "alloc", "plain", "1G", "oom", "alloc", "plain", "32M",
                    "ok", "launch", "kernel", "1", "1", "32", "ok"));
    if (!client_ok(&r))
        return false;
    struct vgpu_state *s = map_state("nodisable");
    bool counted = s->devices[0].launches == 1; /* the totals outlive the process */
    munmap(s, sizeof *s);
    CHECK(counted, "the state file was not written: the shim was off");
    CHECK(count_of(r.err, "libvgpu:") == 1 && strstr(r.err, "VGPU_DISABLE=1 ignored"),
          "expected one warning that VGPU_DISABLE was ignored, got: %s", r.err);
    return true;
}

/* Another VGPU_REGION_DIR (a region of the container's own making, without limits) is ignored
 * while a region is mounted, unless its control allows it. */
static bool t_other_region_dir(bool allowed)
{
    g_control_flags = allowed ? VGPU_CONTROL_ALLOW_REGION_DIR : 0;
    make_region("mounted", 1, &MEM64);
    g_control_flags = 0;
    make_region("forged", 1, &OPEN_CFG); /* no memory limit */
    if (!mount_region("mounted"))
        return false;
    char forged[600], assign[700];
    snprintf(forged, sizeof forged, "%s/forged", g_tmp);
    snprintf(assign, sizeof assign, "VGPU_REGION_DIR=%s", forged);
    char *env[] = {assign, NULL};
    const char *saved = g_lib;
    g_lib = "mounted/libvgpu.so";
    struct run r;
    run_client(&r, NULL, env,
               ARGS("direct", "ctx", "0", "alloc", "plain", "1G", allowed ? "ok" : "oom"));
    g_lib = saved;
    unmount_region();
    if (!client_ok(&r))
        return false;
    if (allowed)
        CHECK(count_of(r.err, "libvgpu:") == 0, "unexpected warning: %s", r.err);
    else
        CHECK(count_of(r.err, "libvgpu:") == 1 && strstr(r.err, "VGPU_REGION_DIR=") &&
                  strstr(r.err, "ignored"),
              "expected one warning that VGPU_REGION_DIR was ignored, got: %s", r.err);
    return true;
}

/* The mounted region is used without any variable at all. */
static bool t_mounted_region_without_variables(void)
{
    make_region("plain-mount", 1, &MEM64);
    if (!mount_region("plain-mount"))
        return false;
    const char *saved = g_lib;
    g_lib = "mounted/libvgpu.so";
    struct run r;
    char *env[] = {"VGPU_REGION_DIR=", NULL};
    run_client(&r, NULL, env, ARGS("direct", "ctx", "0", "alloc", "plain", "1G", "oom"));
    g_lib = saved;
    unmount_region();
    if (!client_ok(&r))
        return false;
    CHECK(count_of(r.err, "libvgpu:") == 0, "unexpected warning: %s", r.err);
    return true;
}

static void policy_tests(void)
{
    report("VGPU_DISABLE=1 is ignored unless control allows it",
           t_disable_needs_the_agents_leave(VGPU_ABI_MINOR, 0));
    report("a 1.0 control allows nothing, whatever its reserved word holds",
           t_disable_needs_the_agents_leave(0, VGPU_CONTROL_ALLOW_DISABLE));
    report("another VGPU_REGION_DIR is ignored while a region is mounted", t_other_region_dir(false));
    report("another VGPU_REGION_DIR is followed when control allows it", t_other_region_dir(true));
    report("the mounted region is found without VGPU_REGION_DIR", t_mounted_region_without_variables());
}
