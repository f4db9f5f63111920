/* fake_ids.h - the UUIDs the fake driver and fake NVML give their devices (shared by the tests). */
#ifndef VGPU_FAKE_IDS_H
#define VGPU_FAKE_IDS_H

#include <stdio.h>

static inline void fake_uuid_bytes(int dev, unsigned char out[16])
{
    for (int k = 0; k < 16; k++)
        out[k] = (unsigned char)((k * 17 + 0x40 + dev * 5) & 0xff);
}

static inline void fake_uuid_text(int dev, char out[48])
{
    unsigned char b[16];
    fake_uuid_bytes(dev, b);
    snprintf(out, 48, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12],
             b[13], b[14], b[15]);
}

#endif
