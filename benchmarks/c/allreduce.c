/* MPI_Allreduce and MPI_Bcast of float32 buffers, timed the way benchmarks/bench_peers.py times Python.

   Two builds of this one file (bench_peers.py --run makes both with the venv's mpicc):
       mpicc -O3 -o build/allreduce allreduce.c                              a program: its own job
       mpicc -O3 -shared -fPIC -DBENCH_LIBRARY -o build/libbench.so allreduce.c   loaded by ctypes
   The program runs as a separate job (mpiexec -n 2 build/allreduce 8 1048576 67108864); the library
   lets bench_peers.py time the same C loop inside its own job, alternating with the Python peers, so
   that its ratio to them is measured under the same machine noise (bench_block below).

   Program arguments: sizes in bytes (multiples of 4). For each size and each of "allreduce" (MPI_SUM, in place),
   "mean" (the same, then a division by the number of ranks, as a framework's gradient mean does) and
   "broadcast" (root 0): warm-up calls, then R rounds, each a barrier and a block of K back-to-back calls
   timed on every rank; a round's time per call is the slowest rank's block time / K. Rank 0 prints one
   JSON object per line: {"impl": "c", "op": ..., "bytes": ..., "rounds": [seconds per call, ...]}.
   K and R follow the same rule as the Python side (about 160 MiB per size, 31..20000 calls). */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* One C loop: k back-to-back calls on MPI_COMM_WORLD; op 0 allreduce, 1 mean, 2 broadcast (root 0).
   Returns seconds per call on this rank. The caller synchronises (a barrier) before. */
double bench_block(int op, float *x, int count, int k) {
    int size;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    const float n = (float)size;
    double t0 = MPI_Wtime();
    for (int i = 0; i < k; i++) {
        if (op == 2) {
            MPI_Bcast(x, count, MPI_FLOAT, 0, MPI_COMM_WORLD);
            continue;
        }
        MPI_Allreduce(MPI_IN_PLACE, x, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        if (op == 1)
            for (int j = 0; j < count; j++) x[j] /= n;
    }
    return (MPI_Wtime() - t0) / k;
}

#ifndef BENCH_LIBRARY

static void plan(long nbytes, int *rounds, int *k) {
    long total = (160L << 20) / nbytes;
    if (total < 31) total = 31;
    if (total > 20000) total = 20000;
    *rounds = total < 61 ? (int)total : 61;
    *k = (int)((total + *rounds - 1) / *rounds);
}

static int op_code(const char *op) {
    return strcmp(op, "broadcast") == 0 ? 2 : strcmp(op, "mean") == 0 ? 1 : 0;
}

int main(int argc, char **argv) {
    int provided, rank, size;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    const char *ops[] = {"allreduce", "mean", "broadcast"};
    for (int a = 1; a < argc; a++) {
        long nbytes = atol(argv[a]);
        if (nbytes < 4 || nbytes % 4) {
            if (rank == 0) fprintf(stderr, "allreduce: size %s is not a positive multiple of 4\n", argv[a]);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
        int count = (int)(nbytes / 4), rounds, k;
        plan(nbytes, &rounds, &k);
        float *x = malloc((size_t)nbytes);
        double *t = malloc(sizeof(double) * rounds);
        for (int o = 0; o < 3; o++) {
            const float fill = strcmp(ops[o], "allreduce") == 0 ? 0.0f : 1.0f;  /* stays finite */
            for (int i = 0; i < count; i++) x[i] = fill;
            int warm = k < 50 ? k : 50;
            if (warm < 2) warm = 2;
            bench_block(op_code(ops[o]), x, count, warm);
            for (int r = 0; r < rounds; r++) {
                MPI_Barrier(MPI_COMM_WORLD);
                t[r] = bench_block(op_code(ops[o]), x, count, k);
            }
            MPI_Allreduce(MPI_IN_PLACE, t, rounds, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            if (rank == 0) {
                printf("{\"impl\": \"c\", \"op\": \"%s\", \"bytes\": %ld, \"calls\": %d, \"rounds\": [",
                       ops[o], nbytes, rounds * k);
                for (int r = 0; r < rounds; r++) printf("%s%.9g", r ? ", " : "", t[r]);
                printf("]}\n");
                fflush(stdout);
            }
        }
        free(x);
        free(t);
    }
    if (rank == 0) {
        char version[MPI_MAX_LIBRARY_VERSION_STRING];
        int len;
        MPI_Get_library_version(version, &len);
        char *nl = strchr(version, '\n');
        if (nl) *nl = '\0';
        printf("{\"impl\": \"c\", \"library\": \"%s\", \"thread_level\": %d}\n", version, provided);
    }
    MPI_Finalize();
    return 0;
}
#endif
