// A table of 256-entry int32 rows that grows at its end and stops moving once large: heap memory (doubling) while
// small, then address space reserved once for the table's cap, whose pages become memory as rows are first
// written. Why: at 8,192 rows (8 MiB) a doubling copied the rows and faulted in the new pages inside whichever
// mask met the new row, 15-40 ms.
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

namespace corral_native {

class RowTable {
  public:
    static constexpr int64_t ROW = 256, MAP_AFTER = 4096;

    explicit RowTable(int32_t fill) : fill_(fill) {}
    RowTable(const RowTable&) = delete;
    RowTable& operator=(const RowTable&) = delete;
    ~RowTable() {
        if (mapped_ != nullptr) munmap(mapped_, size_t(reserved_ * ROW * 4));
    }

    int32_t* data() { return mapped_ != nullptr ? mapped_ : heap_.data(); }
    const int32_t* data() const { return mapped_ != nullptr ? mapped_ : heap_.data(); }
    int64_t rows() const { return rows_; }
    int64_t nbytes() const { return rows_ * ROW * 4; }

    // One more row, every entry `fill`; `cap`: the rows the table may ever hold (the reservation's size).
    void add_row(int64_t cap) {
        if (mapped_ == nullptr && rows_ + 1 > MAP_AFTER && cap > rows_ + 1) reserve(cap);
        if (mapped_ != nullptr && rows_ + 1 <= reserved_) {
            std::fill(mapped_ + rows_ * ROW, mapped_ + (rows_ + 1) * ROW, fill_);
        } else {
            if (mapped_ != nullptr) unmap_to_heap();  // past the cap given: grow on the heap from here
            heap_.resize(size_t((rows_ + 1) * ROW), fill_);
        }
        ++rows_;
    }

  private:
    void reserve(int64_t cap) {
        void* data = mmap(nullptr, size_t(cap * ROW * 4), PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (data == MAP_FAILED) return;  // no address space: the heap it stays
        mapped_ = static_cast<int32_t*>(data);
        reserved_ = cap;
        std::memcpy(mapped_, heap_.data(), size_t(rows_ * ROW * 4));
        std::vector<int32_t>().swap(heap_);
    }
    void unmap_to_heap() {
        heap_.assign(mapped_, mapped_ + rows_ * ROW);
        munmap(mapped_, size_t(reserved_ * ROW * 4));
        mapped_ = nullptr;
        reserved_ = 0;
    }

    int32_t fill_;
    std::vector<int32_t> heap_;
    int32_t* mapped_ = nullptr;
    int64_t reserved_ = 0, rows_ = 0;
};

}  // namespace corral_native
