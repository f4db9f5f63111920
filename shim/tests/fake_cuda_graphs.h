/* fake_cuda_graphs.h - what fake_cuda.c asks of fake_cuda_graphs.c (streams, capture, graphs,
 * kernel run time, versioned entry points and trampolines). Internal to the fake driver. */
#ifndef VGPU_FAKE_CUDA_GRAPHS_H
#define VGPU_FAKE_CUDA_GRAPHS_H

#include "cuda_subset.h"

/* A kernel submitted to a stream: recorded into the stream's capture (*ran = 0), refused
 * (a CUresult), or run for its modelled time (*ran = 1). */
CUresult fake_submit_kernel(CUstream s, int per_thread, CUfunction f, unsigned gx, unsigned gy,
                            unsigned gz, unsigned bx, unsigned by, unsigned bz, int *ran);
CUresult fake_graph_launch(CUgraphExec g, CUstream s, int per_thread);
/* The versioned entry point for (symbol, version, flags): 1 found, -1 known but no version fits,
 * 0 not a base this table knows. */
int fake_versioned_proc(const char *symbol, int version, cuuint64_t flags, void **pfn);
/* With FAKE_CUDA_TRAMPOLINES=1 cuGetProcAddress hands out internal stubs, as real drivers do. */
void *fake_maybe_trampoline(void *fn);
unsigned long long fake_graphs_counter(const char *name); /* ~0ull: unknown name */

#endif
