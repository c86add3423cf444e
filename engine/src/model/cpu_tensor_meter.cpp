#include "smp/cpu_tensor_meter.h"

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>

#include <c10/core/CPUAllocator.h>

namespace smp {
namespace {

// Counts the bytes of the CPU tensors allocated while it is installed and not yet freed: how the profiler sees what a
// module's forward keeps alive for backward. Its pointers are plain (context == data, as raw_allocate requires), so
// it remembers each allocation of the base allocator by address; memory may outlive the installation.
class CountingCpuAllocator final : public c10::Allocator {
 public:
  static CountingCpuAllocator& instance() {
    static CountingCpuAllocator allocator;
    return allocator;
  }
  std::int64_t live_bytes() const { return live_.load(); }
  std::int64_t peak_bytes() const { return peak_.load(); }
  void reset_peak() { peak_.store(live_.load()); }

  c10::DataPtr allocate(size_t bytes) override {
    c10::DataPtr memory = base_->allocate(bytes);
    void* data = memory.get();
    if (data == nullptr) return memory;  // nothing allocated (zero bytes)
    const c10::Device device = memory.device();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      allocations_[data] = {std::move(memory), static_cast<std::int64_t>(bytes)};
    }
    const std::int64_t now = live_ += static_cast<std::int64_t>(bytes);
    for (std::int64_t peak = peak_.load(); now > peak && !peak_.compare_exchange_weak(peak, now);) {
    }
    return {data, data, &release, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* destination, const void* source, std::size_t count) const override {
    base_->copy_data(destination, source, count);
  }

  // While one installation stands, CPU tensors come from the counting allocator. Nested or concurrent ones share
  // the outermost (only the first installs, only the last restores).
  void install() {
    std::lock_guard<std::mutex> lock(installation_mutex());
    if (installations_++ > 0) return;
    base_ = c10::GetCPUAllocator();
    c10::SetCPUAllocator(this, kPriority);
  }
  void uninstall() {
    std::lock_guard<std::mutex> lock(installation_mutex());
    if (--installations_ == 0) c10::SetCPUAllocator(base_, kPriority);
  }

 private:
  static constexpr std::uint8_t kPriority = 255;  // above LibTorch's own registration, and restored at the same
  struct Allocation {
    c10::DataPtr memory;
    std::int64_t bytes = 0;
  };
  static void release(void* data) {
    auto& self = instance();
    Allocation allocation;
    {
      std::lock_guard<std::mutex> lock(self.mutex_);
      auto found = self.allocations_.find(data);
      if (found == self.allocations_.end()) return;
      allocation = std::move(found->second);
      self.allocations_.erase(found);
    }
    self.live_ -= allocation.bytes;
  }  // the base allocator's deleter frees the memory here

  static std::mutex& installation_mutex() {
    static std::mutex mutex;
    return mutex;
  }

  c10::Allocator* base_ = nullptr;
  int installations_ = 0;
  std::atomic<std::int64_t> live_{0};
  std::atomic<std::int64_t> peak_{0};
  std::mutex mutex_;
  std::unordered_map<void*, Allocation> allocations_;
};

}  // namespace

CpuTensorMeter::CpuTensorMeter() { CountingCpuAllocator::instance().install(); }
CpuTensorMeter::~CpuTensorMeter() { CountingCpuAllocator::instance().uninstall(); }
std::int64_t CpuTensorMeter::live_bytes() const { return CountingCpuAllocator::instance().live_bytes(); }
std::int64_t CpuTensorMeter::peak_bytes() const { return CountingCpuAllocator::instance().peak_bytes(); }
void CpuTensorMeter::reset_peak() { CountingCpuAllocator::instance().reset_peak(); }

}  // namespace smp
