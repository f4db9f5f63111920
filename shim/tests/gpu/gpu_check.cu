// gpu_check.cu - what the shim does on a real GPU, through the CUDA runtime (which finds the
// driver's entry points with cuGetProcAddress, so this is the path real applications take).
//
//   gpu_check uuid                          prints the UUID of device 0 (GPU-xxxxxxxx-...)
//   gpu_check mem CHUNK_MIB                 cudaMalloc CHUNK_MIB chunks until refused; prints
//                                           "allocated=B refused=CODE meminfo_total=T meminfo_free=F"
//   gpu_check throughput SECONDS GRID BLOCK SPIN_US
//                                           launches a kernel whose blocks spin SPIN_US each for
//                                           SECONDS; prints "launches_per_s=X cost=TOKENS"
//   gpu_check overhead N                    N launches of an empty kernel, host time per launch;
//                                           prints "ns_per_launch=X"
//   gpu_check ctxmem                        cudaMemGetInfo right after the context exists;
//                                           prints "used=B total=T free=F"
//   gpu_check pool CHUNK_MIB MAX_MIB        cudaMallocAsync until refused (at most MAX_MIB), frees
//                                           into the pool, then cudaMallocFromPoolAsync from a new
//                                           pool until refused; prints "async=B refused=CODE
//                                           second=B held=R" (R: the default pool's reserve)
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CHECK(call)                                                                               \
    do {                                                                                          \
        cudaError_t e_ = (call);                                                                  \
        if (e_ != cudaSuccess) {                                                                  \
            std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e_));                      \
            std::exit(1);                                                                         \
        }                                                                                         \
    } while (0)

__global__ void spin(unsigned long long ns)
{
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}

__global__ void empty() {}

static double seconds_since(std::chrono::steady_clock::time_point t0)
{
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        std::fprintf(stderr, "usage: gpu_check uuid|mem|throughput|overhead ...\n");
        return 2;
    }
    CHECK(cudaSetDevice(0));
    CHECK(cudaFree(0)); // create the context
    if (std::strcmp(argv[1], "uuid") == 0) {
        cudaDeviceProp prop;
        CHECK(cudaGetDeviceProperties(&prop, 0));
        const unsigned char *b = reinterpret_cast<const unsigned char *>(prop.uuid.bytes);
        std::printf("GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x\n",
                    b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11],
                    b[12], b[13], b[14], b[15]);
        return 0;
    }
    if (std::strcmp(argv[1], "mem") == 0 && argc == 3) {
        size_t chunk = std::strtoull(argv[2], nullptr, 10) << 20;
        std::vector<void *> held;
        size_t allocated = 0;
        cudaError_t refused = cudaSuccess;
        for (;;) {
            void *p = nullptr;
            refused = cudaMalloc(&p, chunk);
            if (refused != cudaSuccess)
                break;
            held.push_back(p);
            allocated += chunk;
        }
        cudaGetLastError(); // clear the sticky-free error state of the refusal
        size_t free_b = 0, total_b = 0;
        CHECK(cudaMemGetInfo(&free_b, &total_b));
        std::printf("allocated=%zu refused=%d meminfo_total=%zu meminfo_free=%zu\n", allocated,
                    (int)refused, total_b, free_b);
        for (void *p : held)
            CHECK(cudaFree(p));
        return 0;
    }
    if (std::strcmp(argv[1], "throughput") == 0 && argc == 6) {
        double seconds = std::atof(argv[2]);
        unsigned grid = (unsigned)std::atoi(argv[3]), block = (unsigned)std::atoi(argv[4]);
        unsigned long long spin_ns = std::strtoull(argv[5], nullptr, 10) * 1000ull;
        spin<<<grid, block>>>(spin_ns); // warm up
        CHECK(cudaDeviceSynchronize());
        auto t0 = std::chrono::steady_clock::now();
        unsigned long long launches = 0;
        while (seconds_since(t0) < seconds) {
            spin<<<grid, block>>>(spin_ns);
            launches++;
        }
        CHECK(cudaDeviceSynchronize());
        CHECK(cudaGetLastError());
        std::printf("launches_per_s=%.1f cost=%llu\n", launches / seconds_since(t0),
                    (unsigned long long)grid * block);
        return 0;
    }
    if (std::strcmp(argv[1], "overhead") == 0 && argc == 3) {
        long n = std::atol(argv[2]);
        for (int i = 0; i < 1000; i++)
            empty<<<1, 32>>>();
        CHECK(cudaDeviceSynchronize());
        // batches of 256 so the launch queue never fills and only host-side time is measured
        double host = 0;
        for (long done = 0; done < n; done += 256) {
            auto t0 = std::chrono::steady_clock::now();
            for (int i = 0; i < 256; i++)
                empty<<<1, 32>>>();
            host += seconds_since(t0);
            CHECK(cudaDeviceSynchronize());
        }
        CHECK(cudaGetLastError());
        std::printf("ns_per_launch=%.1f\n", host * 1e9 / (double)((n + 255) / 256 * 256));
        return 0;
    }
    if (std::strcmp(argv[1], "ctxmem") == 0 && argc == 2) {
        size_t free_b = 0, total_b = 0;
        CHECK(cudaMemGetInfo(&free_b, &total_b));
        std::printf("used=%zu total=%zu free=%zu\n", total_b - free_b, total_b, free_b);
        return 0;
    }
    if (std::strcmp(argv[1], "pool") == 0 && argc == 4) {
        size_t chunk = std::strtoull(argv[2], nullptr, 10) << 20;
        size_t most = std::strtoull(argv[3], nullptr, 10) << 20;
        cudaStream_t stream;
        CHECK(cudaStreamCreate(&stream));
        std::vector<void *> held;
        size_t async = 0, second = 0;
        cudaError_t refused = cudaSuccess;
        while (async + chunk <= most) {
            void *p = nullptr;
            refused = cudaMallocAsync(&p, chunk, stream);
            if (refused != cudaSuccess)
                break;
            held.push_back(p);
            async += chunk;
        }
        cudaGetLastError();
        for (void *p : held)
            CHECK(cudaFreeAsync(p, stream));
        held.clear();
        // the default pool keeps what was freed into it: a second pool may not add to it
        cudaMemPool_t pool;
        cudaMemPoolProps props = {};
        props.allocType = cudaMemAllocationTypePinned;
        props.location.type = cudaMemLocationTypeDevice;
        props.location.id = 0;
        CHECK(cudaMemPoolCreate(&pool, &props));
        while (second + chunk <= most) {
            void *p = nullptr;
            if (cudaMallocFromPoolAsync(&p, chunk, pool, stream) != cudaSuccess)
                break;
            held.push_back(p);
            second += chunk;
        }
        cudaGetLastError();
        cudaMemPool_t dflt;
        CHECK(cudaDeviceGetDefaultMemPool(&dflt, 0));
        unsigned long long reserved = 0; // the attribute is a 64-bit value
        CHECK(cudaMemPoolGetAttribute(dflt, cudaMemPoolAttrReservedMemCurrent, &reserved));
        for (void *p : held)
            CHECK(cudaFreeAsync(p, stream));
        CHECK(cudaStreamSynchronize(stream));
        CHECK(cudaMemPoolDestroy(pool));
        std::printf("async=%zu refused=%d second=%zu held=%llu\n", async, (int)refused, second,
                    (unsigned long long)reserved);
        return 0;
    }
    std::fprintf(stderr, "bad arguments\n");
    return 2;
}
