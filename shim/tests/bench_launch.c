/*
 * bench_launch.c - launches on the fake driver, timed in blocks.
 *
 *   bench_launch BLOCKS [PER_BLOCK] [kernel|graph N|capture]
 *
 *   kernel     cuLaunchKernel of 64 x 256 threads (default)
 *   graph N    cuGraphLaunch of one executable graph of N such kernels; the time and the count are
 *              per kernel (a graph launch is amortised over its N kernels)
 *   capture    cuLaunchKernel into a stream being captured (1000 kernels per capture)
 *
 * Prints "median_ns=X p99_ns=Y kernels=K": the median and 99th percentile over blocks of the mean
 * cost per kernel, and how many kernels ran or were captured (warm-up included). Each block of
 * PER_BLOCK (default 1000) kernels is timed with the thread's CPU clock, so time the process spends
 * preempted on a busy machine is not counted. Run by tests/bench/bench_shim.py with and without
 * libvgpu.so preloaded.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda_subset.h"

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double cpu_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static CUfunction const F = (CUfunction)0x6000;

static CUgraphExec graph_of(long n)
{
    CUgraph g;
    CUgraphExec e;
    CUDA_KERNEL_NODE_PARAMS_v2 k;
    memset(&k, 0, sizeof k);
    k.func = F;
    k.gridDimX = 64, k.gridDimY = k.gridDimZ = 1;
    k.blockDimX = 256, k.blockDimY = k.blockDimZ = 1;
    if (cuGraphCreate(&g, 0) != CUDA_SUCCESS)
        return NULL;
    for (long i = 0; i < n; i++) {
        CUgraphNode node;
        if (cuGraphAddKernelNode_v2(&node, g, NULL, 0, &k) != CUDA_SUCCESS)
            return NULL;
    }
    return cuGraphInstantiateWithFlags(&e, g, 0) == CUDA_SUCCESS ? e : NULL;
}

int main(int argc, char **argv)
{
    long blocks = argc > 1 ? atol(argv[1]) : 2000;
    long per = argc > 2 ? atol(argv[2]) : 1000;
    const char *mode = argc > 3 ? argv[3] : "kernel";
    long n = argc > 4 ? atol(argv[4]) : 100;
    if (blocks < 1 || per < 1 || n < 1)
        return 2;
    CUcontext ctx;
    if (cuInit(0) != CUDA_SUCCESS || cuCtxCreate_v2(&ctx, 0, 0) != CUDA_SUCCESS)
        return 1;
    double *mean = malloc(sizeof *mean * (size_t)blocks);
    if (mean == NULL)
        return 1;
    unsigned long long kernels = 0;
    if (strcmp(mode, "kernel") == 0) {
        /* warm up: the first calls resolve symbols and map the region */
        for (int i = 0; i < 10000; i++, kernels++)
            cuLaunchKernel(F, 64, 1, 1, 256, 1, 1, 0, NULL, NULL, NULL);
        for (long b = 0; b < blocks; b++) {
            double t0 = cpu_ns();
            for (long i = 0; i < per; i++)
                if (cuLaunchKernel(F, 64, 1, 1, 256, 1, 1, 0, NULL, NULL, NULL) != CUDA_SUCCESS)
                    return 3;
            mean[b] = (cpu_ns() - t0) / (double)per;
            kernels += (unsigned long long)per;
        }
    } else if (strcmp(mode, "graph") == 0) {
        CUgraphExec e = graph_of(n);
        if (e == NULL)
            return 4;
        long launches = per / n > 0 ? per / n : 1;
        for (int i = 0; i < 100; i++, kernels += (unsigned long long)n)
            cuGraphLaunch(e, NULL);
        for (long b = 0; b < blocks; b++) {
            double t0 = cpu_ns();
            for (long i = 0; i < launches; i++)
                if (cuGraphLaunch(e, NULL) != CUDA_SUCCESS)
                    return 3;
            mean[b] = (cpu_ns() - t0) / (double)(launches * n);
            kernels += (unsigned long long)(launches * n);
        }
    } else if (strcmp(mode, "capture") == 0) {
        CUstream s;
        if (cuStreamCreate(&s, 0) != CUDA_SUCCESS)
            return 4;
        for (long b = -10; b < blocks; b++) { /* ten blocks of warm-up */
            CUgraph g;
            if (cuStreamBeginCapture_v2(s, CU_STREAM_CAPTURE_MODE_GLOBAL) != CUDA_SUCCESS)
                return 5;
            double t0 = cpu_ns();
            for (long i = 0; i < per; i++)
                if (cuLaunchKernel(F, 64, 1, 1, 256, 1, 1, 0, s, NULL, NULL) != CUDA_SUCCESS)
                    return 3;
            double t1 = cpu_ns();
            if (cuStreamEndCapture(s, &g) != CUDA_SUCCESS || cuGraphDestroy(g) != CUDA_SUCCESS)
                return 6;
            if (b >= 0)
                mean[b] = (t1 - t0) / (double)per;
            kernels += (unsigned long long)per;
        }
    } else {
        return 2;
    }
    qsort(mean, (size_t)blocks, sizeof *mean, cmp);
    printf("median_ns=%.2f p99_ns=%.2f kernels=%llu\n", mean[blocks / 2],
           mean[(blocks * 99) / 100], kernels);
    free(mean);
    return 0;
}
