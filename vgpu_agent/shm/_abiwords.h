/*
 * The region ABI's words read from bytes of a `state` file (`shim/include/vgpu_shm.h`):
 * little-endian, at any alignment (a read buffer's offsets are the layout's, not the host's),
 * whatever the host's own order. Shared by `_statec.c` and `_usagec.c`.
 */
#ifndef VGPU_AGENT_ABIWORDS_H
#define VGPU_AGENT_ABIWORDS_H

#include <stdint.h>

static inline uint64_t abi_u64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static inline uint32_t abi_u32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

#endif
