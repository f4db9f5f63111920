/*
 * interpose.c - how calls reach the hooks, and how the hooks reach the real driver.
 *
 * Three ways into the driver are covered:
 *   1. direct calls: the hooks are exported under the driver's names and the shim is preloaded;
 *   2. dlsym(handle, "cuX"): the shim exports dlsym; for a hooked name it remembers the library's
 *      own function (the real one) and returns the hook;
 *   3. cuGetProcAddress / cuGetProcAddress_v2 (how the CUDA 12/13 runtime finds entry points):
 *      the real lookup runs first; when the pointer it returns is the driver's own export of a
 *      hooked name (compared by address), that hook is returned. Real drivers hand out internal
 *      entry points instead: then the driver's rule is applied to versions.def (the newest ABI not
 *      newer than the requested version; its per-thread form when the flag asks and one exists,
 *      else the legacy one) and the hook of exactly that ABI is returned, or none.
 *
 * Every other dlsym call is answered by the C library's dlsym. dlsym(RTLD_NEXT, ...) must search
 * after the *caller's* object, not after the shim: the C library finds the caller from its return
 * address, so the exported dlsym reaches it by a tail jump that leaves that address in place.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <stddef.h>
#include <string.h>

#include "shim.h"

typedef void *(*dlsym_fn)(void *, const char *);

/* dlsym runs before sanitizer runtimes have set themselves up (they resolve their own
 * interceptors through it), so this path must not be instrumented. */
#define NOT_INSTRUMENTED __attribute__((no_sanitize("address", "undefined")))

static const char *const g_names[HOOK_COUNT] = {
#define HOOK(name, base) [HOOK_##name] = #name,
#include "hooks.def"
#undef HOOK
};

static const char *const g_bases[HOOK_COUNT] = {
#define HOOK(name, base) [HOOK_##name] = #base,
#include "hooks.def"
#undef HOOK
};

static void *hook_address(enum hook_id id)
{
    switch (id) {
#define HOOK(name, base)                                                                          \
    case HOOK_##name:                                                                             \
        return (void *)&name;
#include "hooks.def"
#undef HOOK
    default:
        return NULL;
    }
}

void *g_real[HOOK_COUNT];
static void *g_cuda_handle;      /* atomic: the library dlsym'd for cu* names */
static void *g_nvml_handle;      /* atomic: the library dlsym'd for nvml* names */

NOT_INSTRUMENTED static dlsym_fn real_dlsym(void)
{
    static dlsym_fn fn; /* atomic */
    dlsym_fn f = __atomic_load_n(&fn, __ATOMIC_ACQUIRE);
    if (f != NULL)
        return f;
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.0"};
    for (size_t i = 0; i < sizeof versions / sizeof versions[0] && f == NULL; i++)
        f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    __atomic_store_n(&fn, f, __ATOMIC_RELEASE);
    return f;
}

NOT_INSTRUMENTED static int hook_index(const char *name)
{
    if (name == NULL || !((name[0] == 'c' && name[1] == 'u') || strncmp(name, "nvml", 4) == 0))
        return -1;
    for (int i = 0; i < HOOK_COUNT; i++)
        if (strcmp(g_names[i], name) == 0)
            return i;
    return -1;
}

static bool is_nvml(enum hook_id id)
{
    return strncmp(g_names[id], "nvml", 4) == 0;
}

static void remember_real(enum hook_id id, void *real)
{
    void *expected = NULL;
    if (real != NULL && real != hook_address(id))
        __atomic_compare_exchange_n(&g_real[id], &expected, real, false, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE);
}

void *shim_real_by_name(const char *name, bool nvml)
{
    dlsym_fn sym = real_dlsym();
    if (sym == NULL)
        return NULL;
    void *handle = __atomic_load_n(nvml ? &g_nvml_handle : &g_cuda_handle, __ATOMIC_ACQUIRE);
    void *p = handle != NULL ? sym(handle, name) : NULL;
    if (p == NULL)
        p = sym(RTLD_NEXT, name);
    return p;
}

void *shim_real_resolve(enum hook_id id)
{
    void *p = shim_real_by_name(g_names[id], is_nvml(id));
    if (p == hook_address(id))
        return NULL;
    remember_real(id, p);
    return __atomic_load_n(&g_real[id], __ATOMIC_ACQUIRE);
}

/* dlsym for every handle but RTLD_NEXT (reached from the dlsym entry point below). */
NOT_INSTRUMENTED __attribute__((visibility("hidden"), used)) void *vgpu_dlsym_c(void *handle,
                                                                              const char *name)
{
    dlsym_fn sym = real_dlsym();
    if (sym == NULL)
        return NULL;
    void *found = sym(handle, name);
    int id = hook_index(name);
    if (id < 0 || found == NULL || shim_mode() == SHIM_DISABLED)
        return found;
    if (found != hook_address((enum hook_id)id)) {
        remember_real((enum hook_id)id, found);
        if (handle != RTLD_DEFAULT) {
            void *expected = NULL;
            __atomic_compare_exchange_n(is_nvml((enum hook_id)id) ? &g_nvml_handle : &g_cuda_handle,
                                        &expected, handle, false, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE);
        }
    }
    return hook_address((enum hook_id)id);
}

/* dlsym(RTLD_NEXT, name) for a hooked name: the hook, when the real function exists. */
NOT_INSTRUMENTED __attribute__((visibility("hidden"), used)) void *vgpu_next_hook(const char *name)
{
    int id = hook_index(name);
    if (id < 0 || shim_mode() == SHIM_DISABLED || shim_real((enum hook_id)id) == NULL)
        return NULL;
    return hook_address((enum hook_id)id);
}

NOT_INSTRUMENTED static void *no_dlsym(void *handle, const char *name)
{
    (void)handle, (void)name;
    return NULL;
}

/* The C library's dlsym, never NULL (the trampoline jumps to it). */
NOT_INSTRUMENTED __attribute__((visibility("hidden"), used)) void *vgpu_real_dlsym_addr(void)
{
    dlsym_fn f = real_dlsym();
    return f != NULL ? (void *)f : (void *)no_dlsym;
}

/*
 * The exported dlsym. The C library's dlsym(RTLD_NEXT, name) searches after the object that
 * *called* it, found from its return address; so for RTLD_NEXT this entry point jumps to it with
 * the caller's return address still in place (a tail jump, written out per architecture),
 * unless the name is one the shim hooks. Other handles go to vgpu_dlsym_c.
 */
#if defined(__x86_64__)
__asm__(".text\n"
        ".globl dlsym\n"
        ".type dlsym, @function\n"
        "dlsym:\n"
        "    endbr64\n"
        "    cmpq $-1, %rdi\n"
        "    jne vgpu_dlsym_c\n"
        "    pushq %rdi\n"
        "    pushq %rsi\n"
        "    subq $8, %rsp\n"
        "    movq %rsi, %rdi\n"
        "    call vgpu_next_hook\n"
        "    testq %rax, %rax\n"
        "    jnz 1f\n"
        "    call vgpu_real_dlsym_addr\n"
        "    movq %rax, %r11\n"
        "    addq $8, %rsp\n"
        "    popq %rsi\n"
        "    popq %rdi\n"
        "    jmp *%r11\n"
        "1:  addq $24, %rsp\n"
        "    ret\n"
        ".size dlsym, .-dlsym\n");
#elif defined(__aarch64__)
__asm__(".text\n"
        ".globl dlsym\n"
        ".type dlsym, %function\n"
        "dlsym:\n"
        "    cmn x0, #1\n"
        "    b.ne vgpu_dlsym_c\n"
        "    stp x29, x30, [sp, #-32]!\n"
        "    mov x29, sp\n"
        "    stp x0, x1, [sp, #16]\n"
        "    mov x0, x1\n"
        "    bl vgpu_next_hook\n"
        "    cbnz x0, 1f\n"
        "    bl vgpu_real_dlsym_addr\n"
        "    mov x16, x0\n"
        "    ldp x0, x1, [sp, #16]\n"
        "    ldp x29, x30, [sp], #32\n"
        "    br x16\n"
        "1:  ldp x29, x30, [sp], #32\n"
        "    ret\n"
        ".size dlsym, .-dlsym\n");
#else
#error "libvgpu's dlsym entry point is written for x86_64 and aarch64"
#endif

/* The ABI versions of each base name (versions.def). */
struct version_row {
    const char *base;
    int since;
    const char *name;
    const char *per_thread; /* NULL: no per-thread default stream form */
    int per_thread_since;
};

static const struct version_row g_versions[] = {
#define VERSION(base, since, name, per_thread, per_thread_since)                                  \
    {base, since, name, per_thread, per_thread_since},
#include "versions.def"
#undef VERSION
};

/* The exported name the driver hands out for (symbol, cuda_version, flags) by the documented
 * rule: the newest ABI not newer than the requested version; its per-thread form when asked for
 * and it has one, else the legacy one. NULL when no version fits; `known` tells whether the base
 * is in the table at all. */
static const char *versioned_name(const char *symbol, int cuda_version, cuuint64_t flags,
                                  bool *known)
{
    const struct version_row *best = NULL;
    *known = false;
    for (size_t i = 0; i < sizeof g_versions / sizeof g_versions[0]; i++) {
        const struct version_row *row = &g_versions[i];
        if (strcmp(row->base, symbol) != 0)
            continue;
        *known = true;
        if (row->since <= cuda_version && (best == NULL || row->since > best->since))
            best = row;
    }
    if (best == NULL)
        return NULL;
    if ((flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0 && best->per_thread != NULL &&
        cuda_version >= best->per_thread_since)
        return best->per_thread;
    return best->name;
}

/* Which hook answers cuGetProcAddress(symbol) when the driver returned `p`; -1 for none. */
static int hook_for_proc(const char *symbol, void *p, int cuda_version, cuuint64_t flags)
{
    /* know the driver library: the one that defines p */
    if (__atomic_load_n(&g_cuda_handle, __ATOMIC_ACQUIRE) == NULL) {
        Dl_info info;
        struct link_map *lm = NULL;
        void *expected = NULL;
        if (dladdr1(p, &info, (void **)&lm, RTLD_DL_LINKMAP) != 0 && lm != NULL)
            __atomic_compare_exchange_n(&g_cuda_handle, &expected, (void *)lm, false,
                                        __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    }
    /* exactly the driver's export of a hooked name of this base: that hook */
    dlsym_fn sym = real_dlsym();
    void *handle = __atomic_load_n(&g_cuda_handle, __ATOMIC_ACQUIRE);
    for (int i = 0; i < HOOK_COUNT && handle != NULL && sym != NULL; i++)
        if ((strcmp(g_bases[i], symbol) == 0 || strcmp(g_names[i], symbol) == 0) &&
            sym(handle, g_names[i]) == p)
            return i;
    /* a pointer that is not an export (real drivers return internal entry points): the hook
     * of the ABI the driver's rule selects, never one of another version */
    bool known;
    const char *name = versioned_name(symbol, cuda_version, flags, &known);
    if (name != NULL)
        return hook_index(name);
    if (known)
        return -1; /* no version of this base fits the request: nothing of ours either */
    /* a base with a single, unversioned entry point */
    int id = hook_index(symbol);
    return id >= 0 && strcmp(g_bases[id], symbol) == 0 ? id : -1;
}

static void substitute(const char *symbol, void **pfn, int cuda_version, cuuint64_t flags)
{
    if (symbol == NULL || pfn == NULL || *pfn == NULL || shim_mode() == SHIM_DISABLED)
        return;
    if (!(symbol[0] == 'c' && symbol[1] == 'u'))
        return;
    int id = hook_for_proc(symbol, *pfn, cuda_version, flags);
    if (id < 0 || *pfn == hook_address((enum hook_id)id))
        return;
    remember_real((enum hook_id)id, *pfn);
    *pfn = hook_address((enum hook_id)id);
}

SHIM_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion,
                                      cuuint64_t flags)
{
    __typeof__(&cuGetProcAddress) real = REAL(cuGetProcAddress);
    if (real == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = real(symbol, pfn, cudaVersion, flags);
    if (r == CUDA_SUCCESS)
        substitute(symbol, pfn, cudaVersion, flags);
    return r;
}

SHIM_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                         cuuint64_t flags,
                                         CUdriverProcAddressQueryResult *symbolStatus)
{
    __typeof__(&cuGetProcAddress_v2) real = REAL(cuGetProcAddress_v2);
    if (real == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = real(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (r == CUDA_SUCCESS)
        substitute(symbol, pfn, cudaVersion, flags);
    return r;
}
