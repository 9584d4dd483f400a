/* Run a job on the threads of OpenMP's team: those of the libgomp that torch has loaded
 * (this library links libgomp.so.1, which resolves to torch's copy).
 *
 * torch's OpenMP threads keep spinning for a while after each of torch's parallel
 * operations. Threads of any other pool then share the cores with them: on a 2-core Zen 4,
 * the fused engine's ALiBi forward+backward at N = 1,024 takes 1.25x as long on a Python
 * thread pool as on the team (docs/performance.md, "CPU: flash engine", threads). Running
 * the workers on the team's own threads leaves no thread spinning beside them.
 *
 * job(i) runs once for each i < count, thread t taking t, t + team size, ...: all of them
 * run even if the team has fewer threads than asked for. */
#include <stdint.h>
#include <omp.h>

void qkv_run_on_team(int64_t count, void (*job)(int64_t)) {
#pragma omp parallel num_threads(count)
    {
        const int64_t size = omp_get_num_threads();
        for (int64_t i = omp_get_thread_num(); i < count; i += size)
            job(i);
    }
}
