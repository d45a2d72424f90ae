/* How far apart the machine's two cores are, measured now: a cache line passed back and forth between a
 * thread on each core (round trip, ns), and a buffer written on one core and read on the other (GB/s).
 * benchmarks/bench_collectives.py runs it before each of its runs (--repeat): on a virtual machine the host
 * may place the two virtual CPUs on cores that share a last-level cache or not, and moves them between
 * runs; this says which, so that a run's ratios can be read with it.
 *
 *     cc -O2 -pthread -o cores benchmarks/c/cores.c && ./cores 0 1
 *     -> "round_trip_ns 71.3 transfer_gbps 28.1"
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define ROUNDS 200000
#define BYTES (1 << 20)
#define PASSES 64

static _Alignas(64) _Atomic long flag;
static _Alignas(64) _Atomic long turn;  /* the transfer test: which pass the writer has finished */
static char *buffer;
static int cpus[2];

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void *echo(void *arg) {
    (void)arg;
    pin(cpus[1]);
    for (long i = 0; i < ROUNDS; i++) {
        while (atomic_load_explicit(&flag, memory_order_acquire) != 2 * i + 1) {}
        atomic_store_explicit(&flag, 2 * i + 2, memory_order_release);
    }
    /* the transfer: write the buffer, hand it over, wait until it has been read */
    for (long p = 0; p < PASSES; p++) {
        memset(buffer, (int)p, BYTES);
        atomic_store_explicit(&turn, 2 * p + 1, memory_order_release);
        while (atomic_load_explicit(&turn, memory_order_acquire) != 2 * p + 2) {}
    }
    return NULL;
}

int main(int argc, char **argv) {
    cpus[0] = argc > 1 ? atoi(argv[1]) : 0;
    cpus[1] = argc > 2 ? atoi(argv[2]) : 1;
    buffer = aligned_alloc(64, BYTES);
    memset(buffer, 0, BYTES);
    pthread_t other;
    pin(cpus[0]);
    pthread_create(&other, NULL, echo, NULL);
    double t0 = now();
    for (long i = 0; i < ROUNDS; i++) {
        atomic_store_explicit(&flag, 2 * i + 1, memory_order_release);
        while (atomic_load_explicit(&flag, memory_order_acquire) != 2 * i + 2) {}
    }
    double round_trip = (now() - t0) / ROUNDS;
    double reading = 0;
    volatile long sink = 0;
    for (long p = 0; p < PASSES; p++) {
        while (atomic_load_explicit(&turn, memory_order_acquire) != 2 * p + 1) {}
        double t = now();
        const long *words = (const long *)buffer;
        long s = 0;
        for (long k = 0; k < BYTES / (long)sizeof(long); k += 8) s += words[k];  /* one word per line */
        sink += s;
        reading += now() - t;
        atomic_store_explicit(&turn, 2 * p + 2, memory_order_release);
    }
    pthread_join(other, NULL);
    printf("round_trip_ns %.1f transfer_gbps %.2f\n", round_trip * 1e9, (double)BYTES * PASSES / reading / 1e9);
    return 0;
}
