/*
 * bench_launch.c - N cuLaunchKernel calls on the fake driver; prints the mean ns per launch.
 * Run with and without libvgpu.so preloaded by `shim_test BUILD --bench`. Timed with the
 * thread's CPU clock, so time the process spends preempted on a busy machine is not counted.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "cuda_subset.h"

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 1000000;
    CUcontext ctx;
    if (cuInit(0) != CUDA_SUCCESS || cuCtxCreate_v2(&ctx, 0, 0) != CUDA_SUCCESS)
        return 1;
    CUfunction f = (CUfunction)0x6000;
    /* warm up: first calls resolve symbols and map the region */
    for (int i = 0; i < 1000; i++)
        cuLaunchKernel(f, 64, 1, 1, 256, 1, 1, 0, NULL, NULL, NULL);
    struct timespec a, b;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
    for (long i = 0; i < n; i++)
        if (cuLaunchKernel(f, 64, 1, 1, 256, 1, 1, 0, NULL, NULL, NULL) != CUDA_SUCCESS)
            return 2;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
    double ns = (double)(b.tv_sec - a.tv_sec) * 1e9 + (double)(b.tv_nsec - a.tv_nsec);
    printf("ns_per_launch=%.2f\n", ns / (double)n);
    return 0;
}
