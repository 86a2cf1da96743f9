// parallel_chunks: the kernels' fork and join over XLA's intra-op pool, included by small_m_matmul.cc
// inside its namespace (the standard headers are included there).
//
// Why a helper thread of our own: a decode step calls the threaded kernels ~140 times, 0.1-2 ms
// apart, with a few small XLA thunks between. A pool thread woken by Schedule for each call started
// 36-50 us late on average (2-core VM; timestamps around the drains), so wo's and wqkv's ~150-200
// us calls ran a quarter of their time on one thread. Our helper polls a one-slot mailbox every
// kPoll for kLinger after its last job, then sleeps on a condition variable: its mean start was
// 10-12 us, and without it a decode step of the 1.5B target took 1.1-1.5% longer (the per-round
// medians of benchmarks/ab_decode_step.py's `no-helper`, two runs).
//
// It is not a pool thread: a pool thread kept polling starved XLA's own parallel fusions (the
// SwiGLU's, before swiglu.h, went from 40 to 90 us a call). And a helper spinning on sched_yield,
// though it started jobs in 2-3 us, made the step no faster (the two vCPUs may share a core).
// Whoever drains a chunk, its sums are the same, so results do not depend on who ran what.
//
// Safety: the caller returns only after every chunk taken is done and, if its job went through
// the mailbox, after the helper let go of it; a job nobody took is taken back. Two callers at once
// (two devices' steps) find the mailbox full or the helper busy and fall back to Schedule.
// Off: every call schedules on XLA's pool, as before the helper (SsdJaxUseHelper, for A/B runs).
inline std::atomic<bool> g_use_helper{true};
constexpr auto kLinger = std::chrono::microseconds(500);
constexpr auto kPoll = std::chrono::microseconds(2);  // the VM's timers make it ~10 us

struct Job {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::atomic<bool> released{false};  // the mailbox's taker has let go of the job
  int64_t chunks = 0;
  void (*fn)(const void*, int64_t) = nullptr;
  const void* ctx = nullptr;

  // Takes chunks until none is left; a taker that finds none touches nothing but `next`.
  void drain() {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      fn(ctx, c);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

class Helper {
 public:
  // The process's helper, started on first use and never stopped (its thread holds it). A forked
  // child has the object but not the thread: its callers take their jobs back and drain them alone.
  static Helper& get() {
    static Helper* helper = new Helper();
    return *helper;
  }

  // Offers job to the helper: true if it is in the mailbox (the caller must then call `retract`).
  // Not while the helper drains another caller's job: that caller's chunks could keep it long.
  bool post(Job* job) {
    if (busy_.load()) return false;
    Job* empty = nullptr;
    if (!mailbox_.compare_exchange_strong(empty, job)) return false;
    { std::lock_guard<std::mutex> lock(m_); }  // the helper is either before its check or waiting
    cv_.notify_one();
    return true;
  }

  // After the caller's own drain: takes job back if nobody took it, else waits until the taker let go.
  void retract(Job* job) {
    Job* mine = job;
    if (mailbox_.compare_exchange_strong(mine, nullptr)) return;
    while (!job->released.load(std::memory_order_acquire)) std::this_thread::yield();
  }

 private:
  Helper() { std::thread([this]() { loop(); }).detach(); }

  void loop() {
#ifdef __linux__
    prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);  // else a short sleep lasts >= 50 us
#endif
    for (;;) {
      auto last = std::chrono::steady_clock::now();
      for (;;) {
        if (Job* j = mailbox_.exchange(nullptr)) {
          busy_.store(true);
          j->drain();
          j->released.store(true, std::memory_order_release);
          busy_.store(false);
          last = std::chrono::steady_clock::now();
        } else if (std::chrono::steady_clock::now() - last > kLinger) {
          break;
        } else {
          std::this_thread::sleep_for(kPoll);
        }
      }
      std::unique_lock<std::mutex> lock(m_);
      cv_.wait(lock, [this]() { return mailbox_.load() != nullptr; });
    }
  }

  std::atomic<Job*> mailbox_{nullptr};
  std::atomic<bool> busy_{false};
  std::mutex m_;
  std::condition_variable cv_;
};

// Runs run(c) for c in [0, chunks) on the pool's threads and the caller's, and returns when all
// are done. Chunks are taken in order, so put the long ones first.
template <typename Run>
void parallel_chunks(ffi::ThreadPool& pool, int64_t chunks, Run run) {
  const int64_t threads = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), chunks);
  if (threads <= 1) {
    for (int64_t c = 0; c < chunks; ++c) run(c);
    return;
  }
  auto job = std::make_shared<Job>();
  job->chunks = chunks;
  job->fn = [](const void* ctx, int64_t c) { (*static_cast<const Run*>(ctx))(c); };
  job->ctx = &run;
  Helper& helper = Helper::get();
  const bool posted = g_use_helper.load(std::memory_order_relaxed) && helper.post(job.get());
  // One scheduled late finds no chunk left and only touches `next` (the shared_ptr keeps it alive),
  // so the caller waits only for chunks actually taken and cannot deadlock on a busy pool.
  for (int64_t t = posted ? 2 : 1; t < threads; ++t) pool.Schedule([job]() { job->drain(); });
  job->drain();
  if (posted) helper.retract(job.get());
  while (job->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}
