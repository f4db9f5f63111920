/*
 * bench_launch.c - cuLaunchKernel calls on the fake driver, timed in blocks.
 *
 *   bench_launch BLOCKS [PER_BLOCK]    prints "median_ns=X p99_ns=Y" per launch
 *
 * Each block of PER_BLOCK (default 1000) launches is timed with the thread's CPU clock, so time
 * the process spends preempted on a busy machine is not counted; the figures are the median and
 * the 99th percentile of the blocks' mean cost per launch. Run by tests/bench/bench_shim.py with
 * and without libvgpu.so preloaded.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
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

int main(int argc, char **argv)
{
    long blocks = argc > 1 ? atol(argv[1]) : 2000;
    long per = argc > 2 ? atol(argv[2]) : 1000;
    if (blocks < 1 || per < 1)
        return 2;
    CUcontext ctx;
    if (cuInit(0) != CUDA_SUCCESS || cuCtxCreate_v2(&ctx, 0, 0) != CUDA_SUCCESS)
        return 1;
    CUfunction f = (CUfunction)0x6000;
    double *mean = malloc(sizeof *mean * (size_t)blocks);
    if (mean == NULL)
        return 1;
    /* warm up: the first calls resolve symbols and map the region */
    for (int i = 0; i < 10000; i++)
        cuLaunchKernel(f, 64, 1, 1, 256, 1, 1, 0, NULL, NULL, NULL);
    for (long b = 0; b < blocks; b++) {
        double t0 = cpu_ns();
        for (long i = 0; i < per; i++)
            if (cuLaunchKernel(f, 64, 1, 1, 256, 1, 1, 0, NULL, NULL, NULL) != CUDA_SUCCESS)
                return 3;
        mean[b] = (cpu_ns() - t0) / (double)per;
    }
    qsort(mean, (size_t)blocks, sizeof *mean, cmp);
    printf("median_ns=%.2f p99_ns=%.2f\n", mean[blocks / 2], mean[(blocks * 99) / 100]);
    free(mean);
    return 0;
}
