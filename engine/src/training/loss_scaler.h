#pragma once
// fp16's dynamic loss scale, DistributedModel's collaborator: the loss is multiplied by it before backward so that
// small gradients survive half precision, and the gradients divided by it after.

namespace smp {

// The usual schedule: start high, halve on an overflow (whose step is skipped), double after kGrowthInterval steps
// in a row without one. Without fp16 the scale is 1 and never changes.
class LossScaler {
 public:
  static constexpr double kInitialScale = 65536.0;
  static constexpr long long kGrowthInterval = 2000;

  explicit LossScaler(bool fp16) : enabled_(fp16), scale_(fp16 ? kInitialScale : 1.0) {}

  double scale() const { return scale_; }
  long long steps_since_change() const { return good_steps_; }

  // From a checkpoint; ignored without fp16, where the scale does not exist.
  void restore(double scale, long long steps_since_change) {
    if (!enabled_) return;
    scale_ = scale;
    good_steps_ = steps_since_change;
  }

  // The gradients overflowed at this scale: the step is skipped and the scale halved.
  void overflowed() {
    scale_ /= 2.0;
    good_steps_ = 0;
  }

  // A step was taken at this scale.
  void stepped() {
    if (enabled_ && ++good_steps_ % kGrowthInterval == 0) scale_ *= 2.0;
  }

 private:
  bool enabled_;
  double scale_;
  long long good_steps_ = 0;
};

}  // namespace smp
