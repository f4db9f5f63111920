/*
 * fake_cuda_internal.h - what fake_cuda.c and fake_cuda_memory.c share inside the fake driver.
 */
#ifndef VGPU_FAKE_CUDA_INTERNAL_H
#define VGPU_FAKE_CUDA_INTERNAL_H

#include <stdint.h>

#include "cuda_subset.h"

#pragma GCC visibility push(hidden)
int fake_device_count(void);
int fake_current_dev(void);            /* -1 without a current context on this thread */
void fake_set_current_dev(int dev);
CUresult fake_need_ctx(void);
CUresult fake_device_charge(int dev, uint64_t bytes); /* CUDA_ERROR_OUT_OF_MEMORY when full */
void fake_device_uncharge(int dev, uint64_t bytes);
void fake_count_alloc(void);
void *fake_memory_proc(const char *base, int *min_version); /* cuGetProcAddress entries */
#pragma GCC visibility pop

#endif
