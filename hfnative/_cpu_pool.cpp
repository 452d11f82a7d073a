// hfnative's CPU tensor allocator (see hfnative/allocator.py, "The tensor pool").
//
// Tensors of at least `min_size` bytes get page-aligned blocks from one reserved range of address space: the
// best-fitting free block (the lowest address among equal sizes), split when larger, coalesced with its free
// neighbours when freed; a request no free block fits extends the used part of the range (`top`). Freed blocks stay
// resident for reuse; once more than `release_bytes` above `top` were touched and are free again, those pages go back
// to the kernel. Smaller tensors (and any request the range cannot hold) come from posix_memalign, as with c10's
// default CPU allocator. Only tensor storage comes here: the interpreter's and libraries' own small objects stay in
// the C library's heap, where they cannot pin holes between tensor blocks.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <pthread.h>
#include <sys/mman.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <set>
#include <unordered_map>

namespace {

constexpr size_t kAlignment = 64;  // c10's CPU alignment
constexpr size_t kPage = 4096;     // pool blocks are whole pages

struct Pool {
  std::mutex mutex;
  uintptr_t base = 0, end = 0;
  uintptr_t top = 0;      // [base, top): blocks handed out or free; [top, end): not in use
  uintptr_t touched = 0;  // [base, touched): pages that may be resident
  size_t min_size = 0, release_bytes = 0;
  std::set<std::pair<size_t, uintptr_t>> free_by_size;
  std::map<uintptr_t, size_t> free_by_address;
  std::unordered_map<uintptr_t, size_t> live;
  size_t in_use = 0;
  // sizes of the blocks handed out while the profiler records memory (c10's own CPU allocator reports those too)
  std::unordered_map<void*, size_t> profiled;
  std::atomic<size_t> profiled_count{0};

  bool owns(const void* pointer) const {
    auto address = reinterpret_cast<uintptr_t>(pointer);
    return address >= base && address < end;
  }

  void add_free(uintptr_t address, size_t size) {
    free_by_size.emplace(size, address);
    free_by_address.emplace(address, size);
  }

  void remove_free(uintptr_t address, size_t size) {
    free_by_size.erase({size, address});
    free_by_address.erase(address);
  }

  void* take(size_t bytes) {  // caller holds the mutex
    size_t size = (bytes + kPage - 1) & ~(kPage - 1);
    uintptr_t address;
    auto fit = free_by_size.lower_bound({size, 0});
    if (fit != free_by_size.end()) {
      size_t have = fit->first;
      address = fit->second;
      remove_free(address, have);
      if (have > size) add_free(address + size, have - size);
    } else {
      if (end - top < size) return nullptr;
      address = top;
      top += size;
      if (top > touched) touched = top;
    }
    live.emplace(address, size);
    in_use += size;
    return reinterpret_cast<void*>(address);
  }

  void give_back(void* pointer) {  // caller holds the mutex
    auto address = reinterpret_cast<uintptr_t>(pointer);
    auto found = live.find(address);
    if (found == live.end()) std::abort();  // not a block of this pool: a double free
    size_t size = found->second;
    live.erase(found);
    in_use -= size;
    auto next = free_by_address.find(address + size);
    if (next != free_by_address.end()) {
      size_t next_size = next->second;
      remove_free(next->first, next_size);
      size += next_size;
    }
    auto previous = free_by_address.lower_bound(address);
    if (previous != free_by_address.begin()) {
      --previous;
      if (previous->first + previous->second == address) {
        uintptr_t previous_address = previous->first;
        size_t previous_size = previous->second;
        remove_free(previous_address, previous_size);
        address = previous_address;
        size += previous_size;
      }
    }
    if (address + size != top) {
      add_free(address, size);
      return;
    }
    top = address;
    if (touched - top > release_bytes) {
      madvise(reinterpret_cast<void*>(top), touched - top, MADV_DONTNEED);
      touched = top;
    }
  }
};

Pool* pool = nullptr;

void report(void* pointer, int64_t bytes) {  // caller holds the mutex
  c10::reportMemoryUsageToProfiler(pointer, bytes, pool->in_use, pool->touched - pool->base,
                                   c10::Device(c10::DeviceType::CPU));
}

void release(void* pointer) {
  if (pointer == nullptr) return;
  bool pooled = pool->owns(pointer);
  if (!pooled && pool->profiled_count.load(std::memory_order_relaxed) == 0) {
    std::free(pointer);
    return;
  }
  std::lock_guard<std::mutex> lock(pool->mutex);
  auto profiled = pool->profiled.find(pointer);
  size_t profiled_size = 0;
  if (profiled != pool->profiled.end()) {
    profiled_size = profiled->second;
    pool->profiled.erase(profiled);
    pool->profiled_count.fetch_sub(1, std::memory_order_relaxed);
  }
  if (pooled) pool->give_back(pointer);
  else std::free(pointer);
  if (profiled_size != 0) report(pointer, -static_cast<int64_t>(profiled_size));
}

struct PoolAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t bytes) override {
    void* pointer = nullptr;
    bool profiling = c10::memoryProfilingEnabled();
    if (bytes >= pool->min_size) {
      std::lock_guard<std::mutex> lock(pool->mutex);
      pointer = pool->take(bytes);
    }
    if (pointer == nullptr && bytes > 0) {
      if (posix_memalign(&pointer, kAlignment, bytes) != 0) pointer = nullptr;
      if (pointer == nullptr) throw std::bad_alloc();
    }
    if (profiling && pointer != nullptr) {
      std::lock_guard<std::mutex> lock(pool->mutex);
      pool->profiled.emplace(pointer, bytes);
      pool->profiled_count.fetch_add(1, std::memory_order_relaxed);
      report(pointer, static_cast<int64_t>(bytes));
    }
    return {pointer, pointer, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* destination, const void* source, std::size_t count) const override {
    std::memcpy(destination, source, count);
  }
};

// a fork (a DataLoader worker) must not copy the mutex while another thread holds it
void before_fork() { pool->mutex.lock(); }
void after_fork() { pool->mutex.unlock(); }

}  // namespace

// Reserves `reserve_bytes` of address space (no memory) and makes the pool torch's CPU allocator. 1 on success.
extern "C" int hfnative_cpu_pool_install(size_t reserve_bytes, size_t min_size, size_t release_bytes) {
  if (pool != nullptr) return 1;
  void* range = mmap(nullptr, reserve_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (range == MAP_FAILED) return 0;
  auto* created = new Pool();
  created->base = created->top = created->touched = reinterpret_cast<uintptr_t>(range);
  created->end = created->base + reserve_bytes;
  created->min_size = min_size;
  created->release_bytes = release_bytes;
  pool = created;
  pthread_atfork(before_fork, after_fork, after_fork);
  c10::SetCPUAllocator(new PoolAllocator(), /*priority=*/100);
  return 1;
}

// in use (handed out), resident (touched and not given back to the kernel), free blocks below `top`; bytes
extern "C" void hfnative_cpu_pool_stats(size_t* out) {
  std::lock_guard<std::mutex> lock(pool->mutex);
  size_t free_bytes = 0;
  for (const auto& block : pool->free_by_address) free_bytes += block.second;
  out[0] = pool->in_use;
  out[1] = pool->touched - pool->base;
  out[2] = free_bytes;
}
