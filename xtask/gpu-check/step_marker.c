/* The GPU check's native step function. CPython 3.12+ (the PyTorch there) has
 * no USDT function probes, so the loop runs each training step *inside* this
 * function, through a ctypes callback: `profiler --step-symbol
 * PATH:gpu_check_train_step` then sees exact step boundaries on any Python.
 *
 * Built with -nostdlib: no libc, no symbol versions, loads on any glibc. */
typedef int (*step_body)(void);

__attribute__((visibility("default"), noinline)) int gpu_check_train_step(step_body body) {
    int rc = body();
    /* Not a tail call: the return probe fires after the body, on this frame. */
    __asm__ volatile("" ::: "memory");
    return rc;
}
